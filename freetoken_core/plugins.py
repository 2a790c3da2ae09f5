"""The plugin manager: find plugins through entry points, enable a selection, list them.

A plugin is one class (``freetoken_core.processors.Plugin``) named by an entry point of
the ``freetoken.plugins`` group; the entry point's name is the plugin's name. Plugins are
loaded lazily (on the first call that needs them) and once. Enabled plugins are those
chosen with ``--plugins a,b`` or ``FREETOKEN_PLUGINS`` (``all``, the default, or ``none``).
Only enabled plugins are registered with pluggy (their ``freetoken_*`` hook methods);
installed-but-disabled ones are still read for the fields they own, so a request using
them gets a message naming the plugin to enable.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import msgspec
import pluggy

from freetoken_core import hookspecs
from freetoken_core.errors import FreeTokenError, InvalidRequest, param_of
from freetoken_core.faults import RequestError, plugin_failure
from freetoken_core.processors import (
    ChatView,
    LogitsProcessor,
    ModelInfo,
    Plugin,
    PromptView,
    RequestFields,
    ResponseView,
    StopView,
    check_plugin_class,
)

ENV_VAR = "FREETOKEN_PLUGINS"

log = logging.getLogger("freetoken.plugins")


class PluginSelectionError(FreeTokenError):
    """``--plugins`` named a plugin that is not installed, or plugins conflict."""


@dataclass
class PluginInfo:
    """One installed plugin, as ``freetoken plugins`` lists it."""

    name: str
    distribution: str | None
    version: str | None
    enabled: bool
    kind: str
    """``processor`` (a ``LogitsProcessor``) or ``hooks`` (a ``Plugin`` with hooks only)."""
    description: str
    hooks: list[str] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StopHook:
    """One plugin's ``freetoken_check_stop``: the engine calls ``check(views, token_ids)``
    with the rows whose request uses the plugin (``plugin`` in ``params.fields``); an
    exception fails exactly those rows' requests, naming ``plugin``."""

    plugin: str
    check: Callable[[list[StopView], list[int]], dict[int, int | str] | None]


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


def _hook_names(plugin: type) -> list[str]:
    return sorted(n for n in dir(plugin) if n.startswith("freetoken_")
                  and callable(getattr(plugin, n)))


def field_names(cls: type[Plugin]) -> tuple[str, ...]:
    """The request fields plugin class ``cls`` owns."""
    return () if cls.Fields is None else tuple(cls.Fields.__struct_fields__)


def message_field_names(cls: type[Plugin]) -> tuple[str, ...]:
    """The chat request message keys plugin class ``cls`` owns."""
    fields = cls.ChatMessageFields
    return () if fields is None else tuple(fields.__struct_fields__)


class PluginManager:
    """Owns the pluggy manager for one process; see the module docstring."""

    def __init__(self, plugins: str | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        """``plugins``: the selection (``--plugins``); ``options``: the parsed command-line
        options (``freetoken_configure`` receives them once the plugins are loaded)."""
        self._selection_text = plugins if plugins is not None else os.environ.get(ENV_VAR)
        self.options: Mapping[str, Any] = dict(options or {})
        self._pm: pluggy.PluginManager | None = None
        self._installed: dict[str, tuple[EntryPoint, type[Plugin]]] = {}
        self._broken: set[str] = set()
        self._enabled: dict[str, type[Plugin]] = {}
        self._field_owner: dict[str, str] = {}
        self._message_field_owner: dict[str, str] = {}
        self.on_failure: Callable[[RequestError], None] | None = None
        """Called with every ``RequestError`` that ``call_isolated`` raises (metrics)."""

    # -- loading ---------------------------------------------------------------------

    @property
    def pm(self) -> pluggy.PluginManager:
        if self._pm is None:
            self._load()
        assert self._pm is not None
        return self._pm

    def _load_installed(self) -> None:
        """Import every installed plugin class. One that fails to import or breaks the
        contract is a start-up error when it is selected, and is skipped with a warning
        otherwise (a broken package the operator did not ask for must not stop the server)."""
        selection = parse_selection(self._selection_text)
        for ep in entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if ep.name in self._installed or ep.name in self._broken:
                continue
            try:
                cls = ep.load()
                if isinstance(cls, type) and issubclass(cls, Plugin) and not cls.name:
                    cls.name = ep.name
                check_plugin_class(cls)
                if cls.name != ep.name:
                    raise ValueError(f"the class calls itself {cls.name!r}: the names must "
                                     f"agree")
            except Exception as exc:
                message = f"plugin {ep.name} ({ep.value}) cannot be loaded: " \
                          f"{type(exc).__name__}: {exc}"
                if selection is None or ep.name in selection:
                    raise PluginSelectionError(message) from exc
                log.warning("%s; skipped (not selected)", message)
                self._broken.add(ep.name)
                continue
            self._installed[ep.name] = (ep, cls)

    def _load(self) -> None:
        self._load_installed()
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        selection = parse_selection(self._selection_text)
        if selection is not None:
            unknown = sorted(selection - set(self._installed))
            if unknown:
                raise PluginSelectionError(
                    f"unknown plugin(s) {', '.join(unknown)}; installed: "
                    f"{', '.join(sorted(self._installed)) or 'none'}")
        for name, (_, cls) in sorted(self._installed.items()):
            if selection is None or name in selection:
                pm.register(cls, name=name)
                self._enabled[name] = cls
        pm.check_pending()
        self._pm = pm
        self._collect_fields()
        pm.hook.freetoken_configure(options=dict(self.options))

    def _collect_fields(self) -> None:
        for owners, names_of, what in ((self._field_owner, field_names, "request field"),
                                       (self._message_field_owner, message_field_names,
                                        "chat message field")):
            for name, (_, cls) in sorted(self._installed.items()):
                for f in names_of(cls):
                    other = owners.get(f)
                    if other is not None and {other, name} <= set(self._enabled):
                        raise PluginSelectionError(
                            f"plugins {other} and {name} both own the {what} {f!r}")
                    if other is None or name in self._enabled:
                        owners[f] = name

    def add_cli_options(self, parser: argparse.ArgumentParser) -> None:
        """Let every installed plugin add its options (``freetoken_add_cli_options``), each
        in an argument group named after it, before the selection is known."""
        self._load_installed()
        for name, (_, cls) in sorted(self._installed.items()):
            hook = getattr(cls, "freetoken_add_cli_options", None)
            if hook is not None:
                hook(parser=parser.add_argument_group(f"plugin {name}"))

    # -- queries ---------------------------------------------------------------------

    @property
    def enabled(self) -> set[str]:
        self.pm  # noqa: B018 (loads)
        return set(self._enabled)

    def plugin_classes(self) -> dict[str, type[Plugin]]:
        """Enabled plugin name → its class."""
        self.pm  # noqa: B018 (loads)
        return dict(self._enabled)

    def processor_classes(self) -> list[type[LogitsProcessor]]:
        """The enabled plugins that are logits processors."""
        return [cls for _, cls in sorted(self.plugin_classes().items())
                if issubclass(cls, LogitsProcessor)]

    def fields_types(self) -> dict[str, type[RequestFields]]:
        """Enabled plugin name → its ``Fields`` type, for the plugins that own fields."""
        return {name: cls.Fields for name, cls in sorted(self.plugin_classes().items())
                if cls.Fields is not None}

    def field_owners(self) -> dict[str, str]:
        """Each request field an enabled plugin owns → that plugin's name (the fields a
        request may carry beyond the core ones)."""
        self.pm  # noqa: B018 (loads)
        return {f: owner for f, owner in sorted(self._field_owner.items())
                if owner in self._enabled}

    @property
    def hook(self) -> Any:
        """pluggy's hook caller, for hooks whose callers handle plugin failures."""
        return self.pm.hook

    # -- per request -------------------------------------------------------------------

    def call_isolated(self, hook: str, *, firstresult: bool = False, **kwargs: Any) -> Any:
        """Call hook ``hook`` implementation by implementation (in pluggy's order), so that
        a plugin's exception becomes ``RequestError`` naming it. ``FreeTokenError`` (e.g.
        ``InvalidRequest``) passes through unchanged. Returns pluggy's result: the list of
        non-``None`` results, or the first one for ``firstresult`` hooks."""
        caller = getattr(self.pm.hook, hook)
        stage = hook.removeprefix("freetoken_")
        results = []
        for impl in reversed(caller.get_hookimpls()):  # pluggy calls the last registered first
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

    def _failed(self, plugin: str, stage: str, exc: Exception) -> RequestError:
        error = plugin_failure(plugin, stage, exc)
        if self.on_failure is not None:
            self.on_failure(error)
        return error

    def validate(self, params: Any, model: ModelInfo, route: str | None = None) -> None:
        """Turn ``params.extra`` (plugin fields, as sent) into ``params.fields``: per
        enabled plugin that the request uses, its typed ``Fields`` after the plugin's
        ``validate``. Fields no enabled plugin owns, or sent to a ``route`` (``chat``,
        ``completions``; ``None`` offline) the plugin does not serve, are refused; a value
        of the wrong type is a 400 naming the field; a plugin that raises anything but
        ``InvalidRequest`` → ``RequestError`` naming it. Then the fields the used plugins
        imply (``Plugin.implies``) are validated by their owners, with the same checks
        (the 400 names the implying field); one the client sent too is a 400."""
        owners: dict[str, dict[str, Any]] = {}
        for f, value in params.extra.items():
            self.require_field(f)
            owner = self._field_owner[f]
            routes = self._enabled[owner].routes
            if route is not None and route not in routes:
                raise InvalidRequest(f, f"{f!r} is a field of the "
                                        f"{' and '.join(sorted(routes))} route only")
            owners.setdefault(owner, {})[f] = value
        validated = {name: self._validated(name, sent, model, params)
                     for name, sent in sorted(owners.items())}
        implied: dict[str, dict[str, Any]] = {}
        implied_by: dict[str, str] = {}
        for name, fields in sorted(validated.items()):
            if fields is None:
                continue
            try:
                found = self._enabled[name].implies(fields, params)
            except FreeTokenError:
                raise
            except Exception as exc:
                raise self._failed(name, "implies", exc) from exc
            if found is None:
                continue
            for f, value in found.fields.items():
                owner = self._field_owner.get(f)
                if owner is None or owner not in self._enabled:
                    raise InvalidRequest(found.by, f"this {found.by} needs the request field "
                                         f"{f!r}, whose plugin {owner or '(none)'} is not "
                                         f"enabled")
                if f in params.extra or f in implied.get(owner, {}):
                    raise InvalidRequest(f, f"{f!r} cannot be sent with this {found.by}, "
                                            f"which sets it")
                implied.setdefault(owner, {})[f] = value
                implied_by[owner] = found.by
        for name, fields in sorted(implied.items()):
            try:
                validated[name] = self._validated(name, {**owners.get(name, {}), **fields},
                                                  model, params)
            except InvalidRequest as exc:
                by = implied_by[name]
                raise InvalidRequest(by, f"{by}: {exc.message}") from None
        params.fields = {name: fields for name, fields in validated.items()
                         if fields is not None}

    def _validated(self, name: str, sent: dict[str, Any], model: ModelInfo,
                   params: Any) -> RequestFields | None:
        """Plugin ``name``'s typed and validated ``Fields`` from the fields ``sent``;
        ``None`` when the request does not use it."""
        cls = self._enabled[name]
        assert cls.Fields is not None
        try:
            fields = msgspec.convert(sent, cls.Fields)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(param_of(exc) or next(iter(sent)), str(exc)) from None
        try:
            if not cls.uses(fields):
                return None
            return cls.validate(fields, model, params)
        except FreeTokenError:
            raise
        except Exception as exc:
            raise self._failed(name, "validate", exc) from exc

    def message_fields(self, index: int, sent: dict[str, Any]) -> dict[str, Any]:
        """The keys ``sent`` beyond ``role``/``content``/``name`` in chat message ``index``,
        typed by their plugins' ``ChatMessageFields`` and back to plain values (``None``
        dropped); a key no enabled plugin owns, or of the wrong type, is a 400 naming
        ``messages[index].key``."""
        self.pm  # noqa: B018 (loads)
        by_owner: dict[str, dict[str, Any]] = {}
        for key, value in sent.items():
            owner = self._require_owner(self._message_field_owner, key,
                                        f"messages[{index}].{key}", "message field")
            by_owner.setdefault(owner, {})[key] = value
        out: dict[str, Any] = {}
        for owner, values in sorted(by_owner.items()):
            fields_cls = self._enabled[owner].ChatMessageFields
            assert fields_cls is not None
            try:
                typed = msgspec.convert(values, fields_cls)
            except msgspec.ValidationError as exc:
                param = param_of(exc) or next(iter(values))
                raise InvalidRequest(f"messages[{index}].{param}", str(exc)) from None
            out.update({k: v for k, v in msgspec.to_builtins(typed).items() if v is not None})
        return out

    def prepare_chat(self, view: ChatView) -> None:
        """Run ``freetoken_chat_template`` on a chat request about to be rendered."""
        self.call_isolated("freetoken_chat_template", chat=view)

    def require_field(self, name: str) -> None:
        """``InvalidRequest`` naming ``name`` unless an enabled plugin owns that field (the
        message names the plugin to enable when an installed one owns it)."""
        self.pm  # noqa: B018 (loads)
        self._require_owner(self._field_owner, name, name, "field")

    def _require_owner(self, owners: dict[str, str], key: str, param: str, what: str) -> str:
        """The enabled plugin that owns ``key`` in ``owners``; else ``InvalidRequest`` naming
        ``param``, and the plugin to enable when an installed one owns it."""
        owner = owners.get(key)
        if owner is None:
            raise InvalidRequest(param, f"unknown {what} {key!r}: no installed plugin handles "
                                        f"it")
        if owner not in self._enabled:
            raise InvalidRequest(
                param, f"{key!r} is handled by the plugin {owner!r}, which is not enabled; "
                f"start FreeToken with --plugins including {owner}")
        return owner

    def rewrite_prompt(self, view: PromptView) -> str | list[int]:
        """The prompt after ``freetoken_rewrite_prompt`` (unchanged when no plugin answers)."""
        new = self.call_isolated("freetoken_rewrite_prompt", firstresult=True, prompt=view)
        return view.prompt if new is None else new

    def decorates_responses(self) -> bool:
        """Whether an enabled plugin implements ``freetoken_decorate_response``."""
        return bool(self.pm.hook.freetoken_decorate_response.get_hookimpls())

    def decorate_response(self, view: ResponseView) -> None:
        """Run ``freetoken_decorate_response`` on one response or stream chunk."""
        self.call_isolated("freetoken_decorate_response", response=view)

    def stop_hooks(self) -> list[StopHook]:
        """Each enabled plugin's ``freetoken_check_stop``."""
        hooks = []
        for impl in reversed(self.pm.hook.freetoken_check_stop.get_hookimpls()):
            def check(views: list[StopView], tokens: list[int], impl: Any = impl) -> Any:
                return _call_impl(impl, {"sequences": views, "token_ids": tokens})

            hooks.append(StopHook(impl.plugin_name, check))
        return hooks

    def describe(self) -> list[PluginInfo]:
        self.pm  # noqa: B018 (loads)
        infos = []
        for name, (ep, cls) in sorted(self._installed.items()):
            dist = ep.dist
            doc = (cls.__doc__ or "").strip().splitlines()
            infos.append(PluginInfo(
                name=name,
                distribution=dist.metadata["Name"] if dist else None,
                version=dist.version if dist else None,
                enabled=name in self._enabled,
                kind="processor" if issubclass(cls, LogitsProcessor) else "hooks",
                description=doc[0] if doc else "",
                hooks=_hook_names(cls),
                fields=list(field_names(cls)) + [f"messages[].{f}"
                                                 for f in message_field_names(cls)],
            ))
        return infos
