"""llama.cpp's own greedy tokens on the Falcon-H1 test files against FreeToken's (a manual
check, not part of ``make test``: it needs a ``llama-server`` built from llama.cpp's source)::

    python tests/falcon_h1_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_falcon_h1_gguf.py's shapes as F32 files (llama.cpp computes F32 weights
in float32): 0.5b-like (no gated norm), h1r-like (the gated norm, tied embeddings) and f32 (the
gated norm, untied), every µP multiplier folded in by the converter's rules, serves each with
``llama-server`` (flash attention off, an F32 cache) and compares 16 greedy tokens of four
prompts (of 4 to 78 tokens) with FreeToken's (tests/qwen35_llamacpp_check.py's ``check``).
Exits 1 where any differ. Run from the repository root with it on ``PYTHONPATH``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_falcon_h1_files import falcon_h1_model, write_falcon_h1_gguf
from qwen35_llamacpp_check import check
from test_arch_falcon_h1_gguf import MODEL, SHAPES, VOCAB


def main() -> None:
    server = sys.argv[1]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            path = Path(tmp) / f"{shape}-f32.gguf"
            write_falcon_h1_gguf(path, falcon_h1_model(VOCAB, seed=3, **MODEL,
                                                       **SHAPES[shape]["model"]),
                                 weight_type=GGMLQuantizationType.F32)
            # (llama.cpp's CPU flash attention and F16 cache are F16 inside: they move
            # these logits by ~1e-3, enough to flip the near ties of a random model)
            ok &= check(server, path, ("-fa", "off", "-ctk", "f32", "-ctv", "f32"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
