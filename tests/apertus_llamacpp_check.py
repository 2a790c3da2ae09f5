"""llama.cpp's own greedy tokens on an Apertus test file against FreeToken's (a manual check,
not part of ``make test``: it needs a ``llama-server`` built from llama.cpp's source)::

    python tests/apertus_llamacpp_check.py ~/.cache/freetoken/llama.cpp/build/bin/llama-server

Writes tests/test_arch_apertus.py's model as F32 ``apertus`` files (llama.cpp computes F32
weights in float32): one with the xIELU scalars an array a layer (eps as wide as -0.3 in one
layer) and the llama3 scaling as ``rope_freqs``, one without scaling; serves each with
``llama-server`` and compares 16 greedy tokens of four prompts (of 4 to 78 tokens) with
FreeToken's (tests/qwen35_llamacpp_check.py's ``check``). Exits 1 where any differ. Run from
the repository root with it on ``PYTHONPATH``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType
from gguf_apertus_files import apertus_model, write_apertus_gguf
from qwen35_llamacpp_check import check
from test_arch_apertus import VOCAB
from transformers import ApertusConfig, ApertusForCausalLM


def main() -> None:
    server = sys.argv[1]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, rope in (("llama3", {}), ("plain", {"rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0}})):
            path = Path(tmp) / f"apertus-{name}-f32.gguf"
            write_apertus_gguf(path, apertus_model(ApertusConfig, ApertusForCausalLM, VOCAB,
                                                   seed=5, **rope),
                               weight_type=GGMLQuantizationType.F32)
            ok &= check(server, path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
