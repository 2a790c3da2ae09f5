"""FreeToken's ``/tokenize`` of the default GGUF file equals llama-server's ``/tokenize`` on
the same file for the whole GPL-3 text (issue #34's acceptance): 7,639 ids, where
transformers' GGUF conversion gave 7,658 (it dropped SmolLM2's digit split). The ids are
llama.cpp's, recorded in tests/fixtures/gguf_tokenizer_ids.json by
tests/gguf_tokenizer_cases.py (``llama-tokenize``, which tokenizes as llama-server's
``/tokenize``: parse_special, no BOS for this file)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from gguf_tokenizer_cases import FIXTURE, GPL3
from server_fixtures import Server, ok, start_server, stop_server

from freetoken_core.models.resolve import default_gguf_path


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = start_server(default_gguf_path(), "--kv-cache-tokens", "2048")
    try:
        yield srv
    finally:
        stop_server(srv)


def test_tokenize_gpl3_equals_llama_server(server: Server) -> None:
    text = GPL3.read_text(encoding="utf-8")
    expected = json.loads(FIXTURE.read_text(encoding="utf-8"))["gpl3_smollm"]
    assert len(text) == 35149 and len(expected) == 7639
    body = ok(server, "/tokenize", {"prompt": text})
    assert body["count"] == len(body["tokens"]) == 7639
    assert body["tokens"] == expected
    # the place transformers' conversion split differently: "\n\n  " + "0", not "\n\n " + " "
    at = text.index("CONDITIONS\n\n  0.")
    head = ok(server, "/tokenize", {"prompt": text[at:at + 16]})["tokens"]
    assert ok(server, "/detokenize", {"tokens": head[-3:-1]})["prompt"] == "\n\n  0"
    assert ok(server, "/detokenize", {"tokens": body["tokens"]})["prompt"] == text
