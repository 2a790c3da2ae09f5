"""Modules imported on their first use.

The HTTP process of ``freetoken serve`` loads every installed plugin (their hooks validate
requests and decorate responses there) but runs no logits processor, so it needs no torch:
a plugin module that binds ``torch = lazy_import("torch")`` instead of ``import torch`` costs
that process nothing (torch is ~200 MiB of RSS and most of a second to import), while the
engine process, which imported torch before, gets the module itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

__all__ = ["lazy_import"]


class _LazyModule(ModuleType):
    """Stands for a module until an attribute is read: then imports it (the ordinary way,
    into ``sys.modules``) and keeps each attribute read, so that the next reads are plain
    lookups. ``sys.modules`` never holds this stand-in: ``importlib.util.find_spec``, which
    reads a module's ``__spec__`` there (transformers asks it whether torch is installed),
    must not import the module by asking."""

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__name__), attr)
        setattr(self, attr, value)
        return value


def lazy_import(name: str) -> ModuleType:
    """The module ``name``: itself where it is imported already, else a stand-in that imports
    it when one of its attributes is first read. A name that cannot be found raises
    ``ModuleNotFoundError`` at once, as ``import`` would."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return _LazyModule(name)
