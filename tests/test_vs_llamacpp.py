"""bench/vs_llamacpp.py without any server: token accounting on recorded streams of both
servers, the figures and the table, the llama-server command, and the exit with the build hint
when there is no llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import vs_llamacpp as vs
import vs_servers

# Recorded from `freetoken serve` (the model path shortened): 4 tokens of emoji, the second
# and fourth end inside a UTF-8 character, so two chunks carry text; usage comes last, alone.
FREETOKEN_SSE = """\
data: {"id":"cmpl-d2d6","created":1796103100,"model":"m.gguf","choices":[{"index":0,"text":"\U0001f484","finish_reason":null,"stop_reason":null,"logprobs":null}],"usage":null,"object":"text_completion","system_fingerprint":null}

data: {"id":"cmpl-d2d6","created":1796103100,"model":"m.gguf","choices":[{"index":0,"text":"\ufffd","finish_reason":"length","stop_reason":null,"logprobs":null}],"usage":null,"object":"text_completion","system_fingerprint":null}

data: {"id":"cmpl-d2d6","created":1796103100,"model":"m.gguf","choices":[],"usage":{"prompt_tokens":17,"completion_tokens":4,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":16}},"object":"text_completion","system_fingerprint":null}

data: [DONE]
"""

# Recorded from llama-server (llama-cpp-python 0.3.36's llama.cpp; the model path shortened):
# 6 tokens of emoji in two chunks with text; the last chunk carries no text, the finish reason,
# usage and timings; usage is there with or without stream_options.
LLAMACPP_SSE = """\
data: {"choices":[{"text":"🚀","index":0,"logprobs":null,"finish_reason":null}],"created":1796104474,"model":"m.gguf","system_fingerprint":"b0-llama-cpp-python-0.3.36","object":"text_completion","id":"chatcmpl-LYmTbTcdg7xd1EDwStF8XgIEc0gZZQmG"}

data: {"choices":[{"text":"🔥","index":0,"logprobs":null,"finish_reason":null}],"created":1796104474,"model":"m.gguf","system_fingerprint":"b0-llama-cpp-python-0.3.36","object":"text_completion","id":"chatcmpl-LYmTbTcdg7xd1EDwStF8XgIEc0gZZQmG"}

data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1796104474,"model":"m.gguf","system_fingerprint":"b0-llama-cpp-python-0.3.36","object":"text_completion","usage":{"completion_tokens":6,"prompt_tokens":18,"total_tokens":24,"prompt_tokens_details":{"cached_tokens":17}},"id":"chatcmpl-LYmTbTcdg7xd1EDwStF8XgIEc0gZZQmG","timings":{"cache_n":17,"prompt_n":1,"prompt_ms":10.199,"prompt_per_token_ms":10.199,"prompt_per_second":98.04882831650161,"predicted_n":6,"predicted_ms":49.37,"predicted_per_token_ms":9.873999999999999,"predicted_per_second":101.27607859023699}}

data: [DONE]
"""


def replay(sse: str) -> vs.Record:
    """Feed ``sse``'s lines to the accounting, one second apart, from time 0."""
    record = vs.Record(start=0.0)
    for now, line in enumerate(sse.splitlines(), start=1):
        chunk = vs.parse_event(line)
        if chunk is not None:
            vs.add_chunk(record, chunk, float(now))
    return record


def test_freetoken_stream_counts_usage_tokens_and_text_chunks() -> None:
    record = replay(FREETOKEN_SSE)
    assert (record.usage_tokens, record.num_chunks, record.num_tokens) == (4, 2, 4)
    assert (record.first, record.gaps) == (1.0, [2.0])  # blank lines sit between events


def test_llamacpp_stream_counts_usage_tokens_and_text_chunks() -> None:
    record = replay(LLAMACPP_SSE)
    assert (record.usage_tokens, record.timings_tokens, record.num_chunks) == (6, 6, 2)
    assert (record.num_tokens, record.first, record.gaps) == (6, 1.0, [2.0])
    assert vs.summarise(1, [record], 1.0)["timings_disagree"] == 0


def test_without_usage_the_chunks_with_text_are_the_tokens() -> None:
    lines = [line for line in FREETOKEN_SSE.splitlines() if '"usage":{' not in line]
    record = replay("\n".join(lines))
    assert (record.usage_tokens, record.num_tokens) == (None, 2)


def test_a_streamed_error_fails_the_request() -> None:
    line = 'data: {"error": {"message": "boom", "type": "internal_error"}}'
    with pytest.raises(RuntimeError, match="boom"):
        replay(line)


def test_other_lines_are_not_events() -> None:
    assert [vs.parse_event(x) for x in ("", ": ping", "data: [DONE]", "event: x")] == [None] * 4
    assert vs.parse_event('data:{"a": 1}') == {"a": 1}


def test_prompts_differ_from_their_first_words_and_bodies_match_for_both() -> None:
    prompts = [vs.prompt(i) for i in range(64)]
    assert len(set(prompts)) == 64 and prompts[17].startswith("17. ")
    assert len({p.split(": ")[0].split(". ")[1] for p in prompts}) == len(vs.TOPICS)
    body = vs.request_body("m", 3, 128, {"top_k": 40})
    assert body == {"model": "m", "prompt": vs.prompt(3), "max_tokens": 128,
                    "temperature": 0.8, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "top_k": 40}


def test_long_prompts_have_passages_of_their_own_after_the_index() -> None:
    prompts = [vs.prompt(i, 300) for i in range(8)]
    assert all(p.startswith(f"{i}. ") for i, p in enumerate(prompts))
    passages = [p.split("Notes: ")[1].split("\n\n")[0].split() for p in prompts]
    assert all(len(words) == 300 for words in passages)
    assert len({tuple(words[:5]) for words in passages}) == 8  # no passage shared
    assert vs.prompt(3, 300) == prompts[3]  # the same prompt in every run
    assert vs.request_body("m", 3, 16, None, 300)["prompt"] == prompts[3]
    with pytest.raises(SystemExit):
        vs.parse_args(["--prompt-words", "-1"])


def records() -> list[vs.Record]:
    # Two requests of 4 tokens: TTFT 0.1 and 0.3 s; gaps 10, 20, 30 and 20, 20, 20 ms.
    a = vs.Record(0.0, first=0.1, last=0.16, gaps=[0.01, 0.02, 0.03], num_chunks=4,
                  usage_tokens=4)
    b = vs.Record(0.0, first=0.3, last=0.36, gaps=[0.02, 0.02, 0.02], num_chunks=3,
                  usage_tokens=4)
    return [a, b]


def test_summarise() -> None:
    figures = vs.summarise(2, records(), elapsed=0.5)
    assert figures["tok_s"] == 16.0
    assert (figures["tokens"], figures["text_chunks"], figures["usage_reported"]) == (8, 7, 2)
    assert figures["ttft_p50_ms"] == pytest.approx(200.0)
    assert figures["itl_p50_ms"] == pytest.approx(20.0)
    assert vs.summarise(1, [vs.Record(0.0)], 1.0)["itl_p50_ms"] is None


def test_table_has_the_asked_columns_and_dashes_for_a_side_that_did_not_run() -> None:
    ft = vs.summarise(2, records(), elapsed=0.5)
    lc = dict(ft, tok_s=32.0, itl_p50_ms=10.0, ttft_p50_ms=50.0)
    lines = vs.format_table({"freetoken": [ft], "llamacpp": [lc]}).splitlines()
    assert lines[0] == ("| clients | FreeToken tok/s | llama.cpp tok/s | ratio | "
                        "FreeToken ITL p50 | llama.cpp ITL p50 | TTFT p50 FT / llama.cpp |")
    assert lines[2] == "| 2 | 16.0 | 32.0 | 0.50 | 20.0 ms | 10.0 ms | 200 / 50 ms |"
    only = vs.format_table({"freetoken": [ft]}).splitlines()
    assert only[2] == "| 2 | 16.0 | - | - | 20.0 ms | - | 200 / - ms |"


def test_notes_name_missing_usage_short_counts_and_multi_token_chunks() -> None:
    figures = vs.summarise(2, records(), elapsed=0.5)
    note = ("FreeToken, 2 clients: 7 chunks with text for 8 tokens "
            "(held-back UTF-8: one chunk, several tokens)")
    assert vs.accounting_notes({"freetoken": [figures]}, max_tokens=4) == [note]
    figures["usage_reported"] = 1
    notes = vs.accounting_notes({"llamacpp": [figures]}, max_tokens=5)
    assert [n.split(": ")[1].split(" ")[0] for n in notes] == ["1", "8", "7"]
    figures["timings_disagree"] = 2
    assert "2 requests whose timings" in vs.accounting_notes({"llamacpp": [figures]}, 4)[1]


def test_llama_command_gives_every_slot_room_and_extra_args_come_last() -> None:
    cmd = vs.llama_command("/bin/ls", "m.gguf", 8080, 64, 128, 2, ["-c", "999"])
    assert cmd[cmd.index("-np") + 1] == "64" and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("-c") + 1] == "16384" and cmd[-2:] == ["-c", "999"]
    big = vs.llama_command("/bin/ls", "m.gguf", 8080, 64, 512, 2, [])
    assert big[big.index("-c") + 1] == str(64 * (512 + vs_servers.PROMPT_ROOM))


def test_a_missing_llama_server_exits_2_with_the_build_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        vs.main(["--clients", "1", "--json", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert "bash bench/build_llama_server.sh" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_the_script_exits_2_when_the_given_llama_server_is_missing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_llamacpp.py"),
                           "--llama-server", str(tmp_path / "llama-server")],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "bash bench/build_llama_server.sh" in done.stderr
    assert str(tmp_path / "llama-server") in done.stderr


def test_json_figures_are_plain_json() -> None:
    figures = vs.summarise(1, [vs.Record(0.0)], 1.0)
    assert json.loads(json.dumps(figures, allow_nan=False)) == figures


def test_a_side_that_fails_still_prints_the_table_and_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'no model here'\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(vs.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exit_info:
        vs.main(["--only", "llamacpp", "--llama-server", str(fake), "--gguf", "m.gguf",
                 "--clients", "1", "--json", str(out)])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "| clients | FreeToken tok/s |" in captured.out
    assert "failed: llama.cpp: llama.cpp exited (3) while starting" in captured.out
    assert "no model here" in captured.err
    written = json.loads(out.read_text())
    assert written["llamacpp"] == [] and "exited (3)" in written["meta"]["failures"]["llamacpp"]


def test_passes_alternate_the_servers_and_the_table_pools_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """``--passes 2``: FreeToken, llama.cpp, FreeToken, llama.cpp, each a fresh start; a
    client count's tok/s is every pass's tokens over the summed wall time, and a note gives
    each pass's ratio (here the machine halves its speed between the passes)."""
    from contextlib import contextmanager

    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    order: list[str] = []

    @contextmanager
    def running(name, cmd, port, log_path, start_timeout):
        order.append(name)
        yield "http://127.0.0.1:1"

    def measure_side(name, url, args, samples, steps) -> None:
        speed = (2.0 if name == "freetoken" else 1.0) / order.count(vs.LABELS[name])
        assert (steps is not None) == (name == "freetoken")
        for n in args.client_counts:  # n requests of 10 tokens in n / (10 * speed) s
            records = [vs.Record(0.0, first=0.1, gaps=[0.01], num_chunks=10, usage_tokens=10)
                       for _ in range(n)]
            samples[n] = (records, n / (10 * speed))
            if steps is not None:  # 9 decode steps of 8 ms a pass
                total = steps.setdefault(n, [0.0, 0])
                total[0] += 9 * 0.008
                total[1] += 9

    monkeypatch.setattr(vs, "running", running)
    monkeypatch.setattr(vs, "measure_side", measure_side)
    monkeypatch.setattr(vs, "busy_cpus", lambda: 0.0)
    monkeypatch.setattr(vs.signal, "signal", lambda *_: None)
    vs.main(["--llama-server", str(fake), "--gguf", "m.gguf", "--clients", "1,4",
             "--passes", "2", "--max-tokens", "10"])
    assert order == ["FreeToken", "llama.cpp", "FreeToken", "llama.cpp"]
    out = capsys.readouterr().out
    # FreeToken: 2 passes x 4 requests x 10 tokens in 4 / 20 + 4 / 10 s = 0.6 s -> 133.3
    # tok/s; llama.cpp: the same tokens in 4 / 10 + 4 / 5 s = 1.2 s -> 66.7 tok/s.
    assert "| 4 | 133.3 | 66.7 | 2.00 |" in out, out
    assert "note: 4 clients, ratio in each pass: 2.00, 2.00" in out
    assert "2 pass(es) per server, alternating" in out
    # The served ITL (10 ms gaps) against the engine's decode step in the same runs (8 ms).
    assert ("note: FreeToken, 4 clients: ITL p50 10.00 ms, engine decode step 8.00 ms in the "
            "same runs (mean of 18): +25.0 %") in out, out


def test_decode_steps_reads_the_sum_and_count_from_metrics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("# HELP freetoken_engine_decode_step_seconds x\n"
            "# TYPE freetoken_engine_decode_step_seconds summary\n"
            "freetoken_engine_decode_step_seconds_sum 1.25\n"
            "freetoken_engine_decode_step_seconds_count 100\n"
            "freetoken_engine_step_seconds_sum 9.0\n")
    urls = []

    class Response:
        def __init__(self, url: str) -> None:
            urls.append(url)
            self.text = text

    monkeypatch.setattr(vs.httpx, "get", lambda url, timeout: Response(url))
    assert vs.decode_steps("http://127.0.0.1:9") == (1.25, 100)
    assert urls == ["http://127.0.0.1:9/metrics"]
    text = '{"error": {"message": "invalid API key"}}'  # a server started with --api-key
    assert vs.decode_steps("http://127.0.0.1:9") is None
