"""Install a plugin package with pip into the running environment for a test module."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@contextmanager
def pip_installed(source: Path, distribution: str, module: str,
                  copy_to: Path | None = None) -> Iterator[ModuleType]:
    """``pip install`` the package at ``source`` (a regular install, so this running
    interpreter imports it at once), yield its imported ``module``, and uninstall it at the
    end whatever happened in between. With ``copy_to`` (a temporary directory) it installs a
    copy made there, so that the build leaves no litter beside ``source``."""
    if copy_to is not None:
        source = Path(shutil.copytree(source, copy_to / source.name, ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__")))
    try:
        done = pip("install", "--no-deps", "--no-build-isolation", str(source))
        assert done.returncode == 0, done.stdout + done.stderr
        importlib.invalidate_caches()
        yield importlib.import_module(module)
    finally:
        pip("uninstall", "-y", distribution)
        sys.modules.pop(module, None)
        importlib.invalidate_caches()
