"""llama.cpp's own greedy tokens on the Nemotron-H test files against FreeToken's (a manual
check, not part of ``make test``: it needs a ``llama-server`` built from llama.cpp's source)::

    python tests/nemotron_h_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_nemotron_h_gguf.py's two patterns as F32 files (llama.cpp computes F32
weights in float32): nano2-like (``nemotron_h``: Mamba-2, ReLU² MLP and attention blocks) and
nano3-like (``nemotron_h_moe``: Mamba-2, expert and attention blocks, the selection bias, groups
and scale, the shared expert, and the multi-token-prediction block the converter appends),
serves each with ``llama-server`` (flash attention off, an F32 cache) and compares 16 greedy
tokens of four prompts (of 4 to 78 tokens) with FreeToken's (tests/qwen35_llamacpp_check.py's
``check``). Exits 1 where any differ. Run from the repository root with it on
``PYTHONPATH``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_nemotron_h_files import nemotron_h_model, write_nemotron_h_gguf
from qwen35_llamacpp_check import check
from test_arch_nemotron_h_gguf import SHAPES, VOCAB


def main() -> None:
    server = sys.argv[1]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("nano2-like", "nano3-like"):
            path = Path(tmp) / f"{shape}-f32.gguf"
            write_nemotron_h_gguf(path, nemotron_h_model(VOCAB, seed=3,
                                                         **SHAPES[shape]["model"]),
                                  **{**SHAPES[shape]["file"],
                                     "weight_type": GGMLQuantizationType.F32})
            # (llama.cpp's CPU flash attention and F16 cache are F16 inside: they move
            # these logits by ~1e-3, enough to flip the near ties of a random model)
            ok &= check(server, path, ("-fa", "off", "-ctk", "f32", "-ctv", "f32"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
