"""The HTTP process of ``freetoken serve`` runs without torch: it loads every installed
plugin (their hooks validate requests and decorate responses there) but runs no logits
processor, so the built-in plugins bind torch with ``freetoken_core.lazy.lazy_import`` and
the core's server path imports no module that needs it. Torch is ~200 MiB of that process's
RSS and most of a second of its start. (A GGUF model's: a Hugging Face directory's tokenizer
goes through transformers' AutoTokenizer, which imports torch itself.)"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import Server, ok, start_server, stop_server

from freetoken_core.lazy import lazy_import


def test_lazy_import_imports_on_the_first_attribute_read(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "imports"
    counter.write_text("")
    (tmp_path / "lazy_probe_mod.py").write_text(
        f"from pathlib import Path\nPath({str(counter)!r}).write_text("
        f"Path({str(counter)!r}).read_text() + 'x')\nVALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_mod", raising=False)
    probe = lazy_import("lazy_probe_mod")
    # Asking whether it is installed (as transformers asks about torch) imports nothing.
    assert importlib.util.find_spec("lazy_probe_mod") is not None
    assert "lazy_probe_mod" not in sys.modules and counter.read_text() == ""
    assert probe.VALUE == 42 and probe.VALUE == 42
    assert counter.read_text() == "x"  # imported once, into sys.modules
    assert sys.modules["lazy_probe_mod"].VALUE == 42
    assert lazy_import("lazy_probe_mod") is sys.modules["lazy_probe_mod"]
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        lazy_import("no_such_module_here")


@pytest.fixture(scope="module")
def gguf_server() -> Iterator[Server]:
    srv = start_server(None, "--kv-cache-tokens", "2048")  # the default model, every plugin
    try:
        yield srv
    finally:
        stop_server(srv)


def test_the_http_process_serves_every_plugin_without_torch(gguf_server: Server) -> None:
    """Requests that use each built-in plugin's fields (penalties, logit_bias, min_p,
    min_tokens, stop tokens, structured outputs, tool calls) are served, and the server's
    own process has never loaded torch's library (the engine process computes them)."""
    for path, body in [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "presence_penalty": 0.5,
                             "frequency_penalty": 0.3, "repetition_penalty": 1.1,
                             "logit_bias": {"17": 3}, "min_p": 0.1, "min_tokens": 2,
                             "stop_token_ids": [5]}),
        ("/v1/completions", {"prompt": "JSON:", "max_tokens": 8,
                             "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        }),
    ]:
        ok(gguf_server, path, {"model": gguf_server.model, **body})
    maps = Path(f"/proc/{gguf_server.proc.pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc here")
    torch_libraries = [line for line in maps.read_text().splitlines() if "libtorch" in line]
    assert not torch_libraries, torch_libraries[:3]
