"""llama.cpp's own greedy tokens on the qwen35 test files against FreeToken's (a manual check,
not part of ``make test``: it needs a ``llama-server`` built from llama.cpp's source)::

    python tests/qwen35_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_qwen35_gguf.py's 9B-like (value heads tiled by the converter, a
multi-token-prediction block) and equal-heads shapes as F32 files (llama.cpp computes F32
weights in float32; with Q8_0 weights it quantizes the activations too, and its greedy tokens
part from transformers' where two logits are close), serves each with ``llama-server`` and
compares 16 greedy tokens of four prompts (one past a 64-token block of the delta rule) with
FreeToken's. The small-heads shape is left out: llama.cpp takes the value heads as wide as
the key heads (``ssm.state_size`` for both). Exits 1 where any differ."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_qwen35_files import qwen35_model, write_qwen35_gguf
from test_arch_qwen35_gguf import SHAPES, VOCAB
from test_gguf_rope_factors import LONG, served

TEXTS = ["Hello world, this is", "def add(a, b):\n    return", LONG + " " + LONG,
         "The capital of France"]


def llama_tokens(port: int, ids: list[int], n: int) -> list[int]:
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
            "cache_prompt": False, "return_tokens": True, "ignore_eos": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["tokens"]


def check(server: str, path: Path, args: tuple[str, ...] = ()) -> bool:
    """``llama-server`` (with ``args``) on ``path``: its greedy tokens of ``TEXTS`` equal
    FreeToken's (each prompt's printed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "-m", str(path), "--port", str(port), "-c", "1024",
                             "-np", "1", "-t", "2", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        _, prompts, ours = served(path, TEXTS, 16)
        same = True
        for ids, mine in zip(prompts, ours):
            theirs = llama_tokens(port, ids, 16)
            print(f"{path.name}: {len(ids)} prompt tokens: "
                  f"{'equal' if theirs == mine else f'llama.cpp {theirs} FreeToken {mine}'}")
            same &= theirs == mine
        return same
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    server = sys.argv[1]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("9b-like", "equal-heads"):
            path = Path(tmp) / f"{shape}-f32.gguf"
            write_qwen35_gguf(path, qwen35_model(VOCAB, seed=3, **SHAPES[shape]["model"]),
                              **{**SHAPES[shape]["file"],
                                 "weight_type": GGMLQuantizationType.F32})
            ok &= check(server, path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
