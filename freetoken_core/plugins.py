"""The plugin manager: find plugins through entry points, enable a selection, list them.

Plugins are loaded lazily (on the first call that needs them) and once. Installed plugins
are the entry points of the ``freetoken.plugins`` group; enabled plugins are those chosen
with ``--plugins a,b`` or ``FREETOKEN_PLUGINS`` (``all``, the default, or ``none``). Only
enabled plugins are registered with pluggy; installed-but-disabled ones are still read
for the fields they own, so a request using them gets a message naming the plugin.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

import pluggy

from freetoken_core import hookspecs
from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.faults import RequestError, plugin_failure
from freetoken_core.processors import (
    LogitsProcessor,
    ModelInfo,
    StopHook,
    check_processor_class,
)

ENV_VAR = "FREETOKEN_PLUGINS"


class PluginSelectionError(FreeTokenError):
    """``--plugins`` named a plugin that is not installed."""


@dataclass
class PluginInfo:
    """One installed plugin, as ``freetoken plugins`` lists it."""

    name: str
    distribution: str | None
    version: str | None
    enabled: bool
    hooks: list[str] = field(default_factory=list)
    processors: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)


def parse_selection(value: str | None) -> set[str] | None:
    """``None`` → all; ``"none"`` → empty; ``"a,b"`` → {a, b}."""
    if value is None or value.strip() in ("", "all"):
        return None
    if value.strip() == "none":
        return set()
    return {name.strip() for name in value.split(",") if name.strip()}


def _call_impl(impl: pluggy.HookImpl, kwargs: dict[str, Any]) -> Any:
    """One plugin's implementation of a hook, given the arguments it asks for by name."""
    return impl.function(*(kwargs[name] for name in impl.argnames))


def _hook_names(plugin: Any) -> list[str]:
    return sorted(n for n in dir(plugin) if n.startswith("freetoken_")
                  and callable(getattr(plugin, n)))


class PluginManager:
    """Owns the pluggy manager for one process; see the module docstring."""

    def __init__(self, plugins: str | None = None) -> None:
        self._selection_text = plugins if plugins is not None else os.environ.get(ENV_VAR)
        self._pm: pluggy.PluginManager | None = None
        self._installed: dict[str, tuple[EntryPoint, ModuleType]] = {}
        self._enabled: set[str] = set()
        self._field_owner: dict[str, str] = {}
        self._processors: dict[str, list[type[LogitsProcessor]]] = {}
        self.on_failure: Callable[[RequestError], None] | None = None
        """Called with every ``RequestError`` that ``call_isolated`` raises (metrics)."""

    # -- loading ---------------------------------------------------------------------

    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            self._load()
        assert self._pm is not None
        return self._pm

    def _load(self) -> None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if ep.name not in self._installed:
                self._installed[ep.name] = (ep, ep.load())
        selection = parse_selection(self._selection_text)
        if selection is not None:
            unknown = sorted(selection - set(self._installed))
            if unknown:
                raise PluginSelectionError(
                    f"unknown plugin(s) {', '.join(unknown)}; installed: "
                    f"{', '.join(sorted(self._installed)) or 'none'}")
        for name, (_, module) in sorted(self._installed.items()):
            if selection is None or name in selection:
                pm.register(module, name=name)
                self._enabled.add(name)
        pm.check_pending()
        self._pm = pm
        self._collect_fields()
        self._collect_processors()

    def _collect_fields(self) -> None:
        for name, (_, module) in sorted(self._installed.items()):
            fn = getattr(module, "freetoken_request_fields", None)
            for f in (fn() if fn else []) or []:
                other = self._field_owner.get(f)
                if other is not None and {other, name} <= self._enabled:
                    raise PluginSelectionError(
                        f"plugins {other} and {name} both own the request field {f!r}")
                if other is None or name in self._enabled:
                    self._field_owner[f] = name

    def _collect_processors(self) -> None:
        for name, (_, module) in sorted(self._installed.items()):
            found: list[type[LogitsProcessor]] = []
            fn = getattr(module, "freetoken_register_processors", None)
            if fn is not None:
                fn(register=found.append)
            for cls in found:
                check_processor_class(cls)
            self._processors[name] = found

    # -- queries ---------------------------------------------------------------------

    @property
    def enabled(self) -> set[str]:
        self.pm  # noqa: B018 (loads)
        return set(self._enabled)

    def processor_classes(self) -> list[type[LogitsProcessor]]:
        """Processor classes of the enabled plugins (``freetoken_register_processors``)."""
        self.pm  # noqa: B018 (loads)
        return [cls for name in sorted(self._enabled) for cls in self._processors[name]]

    def processor_owners(self) -> dict[str, str]:
        """Processor name → the enabled plugin that registered it."""
        self.pm  # noqa: B018 (loads)
        return {cls.name: name for name in sorted(self._enabled)
                for cls in self._processors[name]}

    def call_isolated(self, hook: str, *, firstresult: bool = False, **kwargs: Any) -> Any:
        """Call hook ``hook`` implementation by implementation (in pluggy's order), so that
        a plugin's exception becomes ``RequestError`` naming it. ``FreeTokenError`` (e.g.
        ``InvalidRequest``) passes through unchanged. Returns pluggy's result: the list of
        non-``None`` results, or the first one for ``firstresult`` hooks."""
        caller = getattr(self.pm.hook, hook)
        stage = hook.removeprefix("freetoken_")
        impls = caller.get_hookimpls()
        if any(impl.hookwrapper or impl.wrapper for impl in impls):
            # Wrappers need pluggy's own calling loop; the failure cannot be attributed.
            try:
                return caller(**kwargs)
            except FreeTokenError:
                raise
            except Exception as exc:
                raise self._failed("(a hook wrapper)", stage, exc) from exc
        results = []
        for impl in reversed(impls):  # pluggy calls the last registered first
            try:
                result = _call_impl(impl, kwargs)
            except FreeTokenError:
                raise
            except Exception as exc:
                raise self._failed(impl.plugin_name, stage, exc) from exc
            if result is not None:
                if firstresult:
                    return result
                results.append(result)
        return None if firstresult else results

    def field_owners(self) -> dict[str, str]:
        """Each request field an enabled plugin owns → that plugin's name (the fields a
        request may carry beyond the core ones)."""
        self.pm  # noqa: B018 (loads)
        return {f: owner for f, owner in sorted(self._field_owner.items())
                if owner in self._enabled}

    def _failed(self, plugin: str, stage: str, exc: Exception) -> RequestError:
        error = plugin_failure(plugin, stage, exc)
        if self.on_failure is not None:
            self.on_failure(error)
        return error

    def validate(self, params: Any, model: ModelInfo) -> None:
        """Refuse plugin fields nobody enabled owns, then run ``freetoken_validate_request``
        (a plugin that raises anything but ``InvalidRequest`` → ``RequestError``)."""
        for f in params.extra:
            self.require_field(f)
        self.call_isolated("freetoken_validate_request", request=params, model=model)

    def require_field(self, name: str) -> None:
        """``InvalidRequest`` naming ``name`` unless an enabled plugin owns that field (the
        message names the plugin to enable when an installed one owns it)."""
        self.pm  # noqa: B018 (loads)
        owner = self._field_owner.get(name)
        if owner is None:
            raise InvalidRequest(name, f"unknown field {name!r}: no installed plugin handles it")
        if owner not in self._enabled:
            raise InvalidRequest(
                name, f"{name!r} is handled by the plugin {owner!r}, which is not enabled; "
                f"start FreeToken with --plugins including {owner}")

    def rewrite_prompt(self, request: Any, prompt: str | list[int], tokenizer: Any
                       ) -> str | list[int]:
        """``prompt`` after ``freetoken_rewrite_prompt`` (unchanged when no plugin answers)."""
        new = self.call_isolated("freetoken_rewrite_prompt", firstresult=True,
                                 request=request, prompt=prompt, tokenizer=tokenizer)
        return prompt if new is None else new

    def decorate_response(self, request: Any, response: Any, output: Any) -> None:
        """Run ``freetoken_decorate_response`` on one response or stream chunk."""
        self.call_isolated("freetoken_decorate_response", request=request,
                           response=response, output=output)

    def stop_fields(self) -> set[str]:
        """Fields owned by enabled plugins that implement ``freetoken_check_stop``."""
        pm = self.pm
        names = {pm.get_name(impl.plugin) for impl in pm.hook.freetoken_check_stop.get_hookimpls()}
        return {f for f, owner in self._field_owner.items() if owner in names}

    def stop_hooks(self) -> list[StopHook]:
        """Each enabled plugin's ``freetoken_check_stop`` with the fields it owns."""
        pm = self.pm
        hooks = []
        for impl in reversed(pm.hook.freetoken_check_stop.get_hookimpls()):
            name = impl.plugin_name
            fields = frozenset(f for f, owner in self._field_owner.items() if owner == name)

            def check(views: list[Any], tokens: list[int], impl: Any = impl) -> Any:
                return _call_impl(impl, {"sequences": views, "token_ids": tokens})

            hooks.append(StopHook(name, fields, check))
        return hooks

    def describe(self) -> list[PluginInfo]:
        self.pm  # noqa: B018 (loads)
        infos = []
        for name, (ep, module) in sorted(self._installed.items()):
            dist = ep.dist
            infos.append(PluginInfo(
                name=name,
                distribution=dist.metadata["Name"] if dist else None,
                version=dist.version if dist else None,
                enabled=name in self._enabled,
                hooks=_hook_names(module),
                processors=[c.name for c in self._processors.get(name, [])],
                fields=sorted(f for f, owner in self._field_owner.items() if owner == name),
            ))
        return infos
