"""llama.cpp's own greedy tokens on the Granite 4 test files against FreeToken's (a manual
check, not part of ``make test``: it needs a ``llama-server`` built from llama.cpp's source)::

    python tests/granite4_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_granite4_gguf.py's shapes as F32 files (llama.cpp computes F32 weights
in float32): h-tiny-like (``granitehybrid``: Mamba-2 layers, experts and the shared MLP,
RoPE), h-micro-like (``granitehybrid``, dense, NoPE) and micro-like (``granite``: attention
only), serves each with ``llama-server`` and compares 16 greedy tokens of four prompts (of 4
to 78 tokens) with FreeToken's (tests/qwen35_llamacpp_check.py's ``check``). Exits 1 where
any differ. Run from the repository root with it on ``PYTHONPATH``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_granite4_files import granite4_model, write_granite4_gguf
from qwen35_llamacpp_check import check
from test_arch_granite4_gguf import SHAPES, VOCAB


def main() -> None:
    server = sys.argv[1]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            path = Path(tmp) / f"{shape}-f32.gguf"
            write_granite4_gguf(path, granite4_model(VOCAB, seed=3, **SHAPES[shape]["model"]),
                                **{**SHAPES[shape]["file"],
                                   "weight_type": GGMLQuantizationType.F32})
            ok &= check(server, path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
