"""Tensor parallelism (``tensor_parallel_size=2``, gloo + shared memory on this machine):
the split itself, and greedy tokens equal to one rank's on the exactness prompts, for the
default model and random Qwen3-, Gemma 2- and Gemma 3-shaped models as HF directories and
GGUF files."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from gguf_models import write_gguf
from server_fixtures import free_port
from test_arch_gemma2 import make_gemma2
from test_arch_gemma3 import make_gemma3
from test_arch_phi3 import make_phi3
from test_model_exactness import PROMPTS
from tiny_models import make_tiny_model

from freetoken_core import LLM, SamplingParams
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf_weights import GGUFWeight
from freetoken_core.models.sharding import HeadSplit, even_ranges, head_splits, take_columns

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_even_ranges_give_the_first_ranks_the_remainder() -> None:
    assert even_ranges(9, 2) == [(0, 5), (5, 9)]
    assert even_ranges(49152, 2) == [(0, 24576), (24576, 49152)]


def test_kv_heads_split_unevenly_with_their_query_heads() -> None:
    # SmolLM2: 9 query heads on 3 KV heads; 2 ranks hold 2 + 1 KV heads.
    assert head_splits(9, 3, 2) == [HeadSplit(0, 6, 0, 2), HeadSplit(6, 9, 2, 3)]


def test_more_ranks_than_kv_heads_share_a_kv_head() -> None:
    assert head_splits(8, 2, 4) == [HeadSplit(0, 2, 0, 1), HeadSplit(2, 4, 0, 1),
                                    HeadSplit(4, 6, 1, 2), HeadSplit(6, 8, 1, 2)]
    with pytest.raises(ModelLoadError, match="cannot split 9 attention heads"):
        head_splits(9, 3, 4)


def test_columns_are_cut_on_block_boundaries() -> None:
    rows = np.arange(4 * 2 * 144, dtype=np.uint8).reshape(4, 2 * 144)  # Q4_K: 256 a block
    weight = GGUFWeight("blk.0.ffn_down.weight", 12, (4, 512), rows)
    right = take_columns(weight, 256, 512)
    assert right.shape == (4, 256) and (right.rows == rows[:, 144:]).all()
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight .*blocks hold 256"):
        take_columns(dataclasses.replace(weight), 128, 512)


def _greedy(model: str, prompts: list[list[int]], tp: int, **options) -> list[list[int]]:
    with LLM(model, tensor_parallel_size=tp, kv_cache_tokens=4096, progress=False,
             **options) as llm:
        outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _check_tp_equals_one_rank(model: str, **options) -> None:
    with LLM(model, kv_cache_tokens=4096, progress=False, **options) as llm:
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    assert _greedy(model, prompts, 2, **options) == one
    assert not _children(), "a rank outlived its engine"
    # Rank 0 was this thread, pinned to its CPUs while the group ran: given back.
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "tp_rank" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_default_model_tp2_equals_tp1() -> None:
    _check_tp_equals_one_rank(None)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "smollm2"])
def test_hf_dir_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    _check_tp_equals_one_rank(str(make_tiny_model(tmp_path / arch, arch)), dtype="float32")


@pytest.mark.parametrize("make", [make_gemma2, make_gemma3, make_phi3],
                         ids=["gemma2", "gemma3", "phi3"])
def test_hf_dir_gemma3_phi3_tp2_equal_tp1(make, tmp_path: Path) -> None:
    _check_tp_equals_one_rank(str(make(tmp_path / "model")), dtype="float32")


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "llama", "phi3", "glm4"])
def test_gguf_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    # (glm4: rotating half of each head, as its files do)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, ff=256,
                      rope_dims=8 if arch == "glm4" else None)
    _check_tp_equals_one_rank(str(path))


def test_two_nodes_over_mp(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two "nodes" on 127.0.0.1: node 1 runs ``freetoken serve --headless``, node 0 the
    engine; the ranks meet at --master-port over gloo (no shared memory between nodes)."""
    port = free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--kv-cache-tokens", "4096"]
    log = (tmp_path / "headless.log").open("w")
    headless = subprocess.Popen(
        [sys.executable, "-m", "freetoken_core.cli", "serve", "--model", str(tiny_model_dir),
         "--headless", "--node-rank", "1", *flags], stdout=log, stderr=subprocess.STDOUT)
    try:
        with LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False) as llm:
            prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
            one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        with LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, master_port=port,
                 kv_cache_tokens=4096, progress=False) as llm:
            two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert two == one
        assert headless.poll() is None, "the headless node stopped with the group"
    finally:
        headless.send_signal(signal.SIGTERM)
        assert headless.wait(15) == 0, (tmp_path / "headless.log").read_text()
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(port) in " ".join(p.info["cmdline"] or [])]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local Ray cluster (``ray start --head``) for the module; its address."""
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        pytest.skip("Ray is not installed (pip install ray)")
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=120)
    yield f"127.0.0.1:{port}"
    import ray

    ray.shutdown()  # this process's driver, before its cluster goes
    subprocess.run([str(ray_bin), "stop", "--force"], check=False, env=env, capture_output=True,
                   timeout=60)


def test_ray_actors_run_the_other_ranks(ray_head: str, tiny_model_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    with LLM(str(tiny_model_dir), kv_cache_tokens=4096, progress=False) as llm:
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(str(tiny_model_dir), tensor_parallel_size=2, distributed_executor_backend="ray",
             kv_cache_tokens=4096, progress=False) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert two == one


def test_logprobs_and_prompt_logprobs_on_tp2(tiny_model_dir: Path) -> None:
    """Rank 0 scores prompt positions and sampled tokens from the gathered logits: the
    same tokens and ranks as one rank, logprobs within float32 rounding."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    prompt = "The quick brown fox jumps over the lazy dog. " * 40  # > 256 rows: 2 chunks
    outs = {}
    for tp in (1, 2):
        with LLM(str(tiny_model_dir), tensor_parallel_size=tp, kv_cache_tokens=4096,
                 progress=False) as llm:
            outs[tp] = llm.generate(prompt, params)[0]
    one, two = outs[1], outs[2]
    assert two.outputs[0].token_ids == one.outputs[0].token_ids
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].rank == b[token].rank
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_an_o_projection_bias_is_added_once(tmp_path: Path) -> None:
    """Llama's ``attention_bias`` gives the o projection a bias too (as gpt-oss has one): one
    rank adds it to the all-reduced sum. TP=1 matches transformers, and TP=2 TP=1."""
    import torch
    from test_arch_phi3 import save_tiny_model
    from test_gguf_rope_factors import greedy, served
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    model_dir = save_tiny_model(tmp_path / "llama-bias", LlamaConfig, HFLlama,
                                attention_bias=True)
    hf = HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    llm, prompts, got = served(model_dir, PROMPTS, 12)
    llm.close()
    assert got == greedy(hf, prompts, 12)
    _check_tp_equals_one_rank(str(model_dir), dtype="float32")
