"""FREETOKEN_KERNEL_MARCH: which -march the native kernels are built for, and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from freetoken_core import kernels


def _sources() -> list[Path]:
    return [Path(kernels.__file__).parent / "csrc" / name for name in kernels._SOURCES]


def test_native_by_default_and_the_same_build_directory(monkeypatch):
    monkeypatch.delenv("FREETOKEN_KERNEL_MARCH", raising=False)
    assert kernels.kernel_march() == "native"
    default = kernels._build_dir(_sources())
    monkeypatch.setenv("FREETOKEN_KERNEL_MARCH", "native")
    assert kernels._build_dir(_sources()) == default


def test_another_target_gets_its_own_build_directory(monkeypatch):
    monkeypatch.delenv("FREETOKEN_KERNEL_MARCH", raising=False)
    native = kernels._build_dir(_sources())
    monkeypatch.setenv("FREETOKEN_KERNEL_MARCH", "x86-64-v3")
    assert kernels.kernel_march() == "x86-64-v3"
    v3 = kernels._build_dir(_sources())
    monkeypatch.setenv("FREETOKEN_KERNEL_MARCH", "znver3")
    assert len({native, v3, kernels._build_dir(_sources())}) == 3


@pytest.mark.parametrize("value", ["native -O0", "x; rm -rf /", "-mavx2", "zn ver3"])
def test_a_value_that_is_not_a_target_name_is_refused(monkeypatch, value):
    monkeypatch.setenv("FREETOKEN_KERNEL_MARCH", value)
    with pytest.raises(ValueError, match="FREETOKEN_KERNEL_MARCH"):
        kernels.kernel_march()
