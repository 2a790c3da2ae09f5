"""bench/gpu_check.py without CUDA: every CUDA part says it is skipped, the CPU sample runs,
and the run passes. (On a CUDA machine run ``bash bench/gpu_check.sh`` itself.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check

CUDA_PARTS = ("kernel tests", "exactness vs transformers (fp32)", "decode, default model",
              "decode, 1B-shaped Llama", "tensor-parallel group, TP=1")


def test_kernel_test_files_are_the_modules_with_triton_kernel_tests() -> None:
    files = gpu_check.kernel_test_files()
    assert {"tests/test_plugin_min_p.py", "tests/test_plugin_penalties.py",
            "tests/test_structured_grammar.py"} <= set(files)
    assert "tests/test_model_exactness.py" not in files


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs for minutes")
def test_without_cuda_the_cuda_parts_are_skipped_and_the_check_passes() -> None:
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    for name in CUDA_PARTS:
        assert f"[{name}] skipped: no CUDA device" in out
        assert re.search(rf"^{re.escape(name)}\s+cuda\s+skipped\s", out, re.MULTILINE), name
    # The CUDA exactness tests exist and are collected, skipped here.
    assert re.search(r"no CUDA device \(\d+ skipped", out)
    assert re.search(r"^decode code path, tiny model\s+cpu\s+passed\s.*tok/s 1: \d+, 16: \d+, "
                     r"64: \d+", out, re.MULTILINE)
    assert re.search(r"^tensor-parallel group code path\s+cpu\s+passed\s+\d+ s\s+gloo; collectives ok, "
                     r"logits diff 0.0", out, re.MULTILINE)
    assert ", 0 failed, in " in out


def test_a_failing_test_fails_its_check(tmp_path: Path) -> None:
    test = tmp_path / "test_fails.py"
    test.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    assert False\n")
    result = gpu_check.pytest_check("sample", "cpu", [str(test)], 120, dict(os.environ))
    assert result.status == "failed" and "1 failed" in result.figures
