"""llama.cpp's own greedy tokens on the ERNIE 4.5 MoE and Hunyuan MoE test files against
FreeToken's (a manual check, not part of ``make test``: it needs a ``llama-server`` built from
llama.cpp's source)::

    python tests/ernie_hunyuan_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_ernie_hunyuan_moe_gguf.py's ERNIE shapes 21b-like (a dense first
layer, shared experts) and 300b-like (two dense layers, no shared experts, tied) and its
Hunyuan MoE as F32 files (llama.cpp computes F32 weights in float32), serves each with
``llama-server`` (its KV cache float32 and flash attention off: with its default float16 cache
the top log-probabilities part from transformers' by up to ~0.1 on these random models, whose
logits run to ~35, and a near tie can go the other way) and compares 16 greedy tokens of four
prompts with FreeToken's (tests/qwen35_llamacpp_check.py's ``check``). The interleaved ERNIE shape is left out:
llama.cpp's loader gives every layer past the dense lead experts, whatever
``interleave_moe_layer_step`` says. Exits 1 where any differ. Run from the repository root
with it on ``PYTHONPATH``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_ernie_hunyuan_files import ernie_moe_model, hunyuan_moe_model, write_moe_gguf
from qwen35_llamacpp_check import check
from test_arch_ernie_hunyuan_moe_gguf import ERNIE_SHAPES
from test_arch_glm4_moe import VOCAB


def main() -> None:
    server = sys.argv[1]
    models = {f"ernie-{shape}": ernie_moe_model(VOCAB, seed=3, **ERNIE_SHAPES[shape][0])
              for shape in ("21b-like", "300b-like")}
    models["hunyuan"] = hunyuan_moe_model(VOCAB, seed=4)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            path = Path(tmp) / f"{name}-f32.gguf"
            write_moe_gguf(path, model, GGMLQuantizationType.F32)
            ok &= check(server, path, ("-ctk", "f32", "-ctv", "f32", "-fa", "off"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
