"""Generation defaults: what a request that leaves a sampling field unset gets instead.

The sources, chosen with ``--generation-config`` / ``EngineConfig.generation_config``:
``auto`` (the model directory's ``generation_config.json``; a GGUF file, or a directory
without that file, has none), ``none``, or a path (a directory holding
``generation_config.json``, or the file itself); then ``--override-generation-config``
(``EngineConfig.override_generation_config``), whose keys win over the file's one by one.

Each key applies under its own name when it is a core field in ``DEFAULTABLE_FIELDS`` or a
request field an enabled plugin owns (Hugging Face's names equal the OpenAI / vLLM ones for
the sampling fields). Two keys are renamed: ``max_new_tokens`` is the default
``max_tokens``, and ``eos_token_id`` (an id or a list) adds ids to the model's EOS set, on
which generation stops. ``do_sample`` is ignored, as vLLM ignores it: the temperature
decides. Every other key is reported, never dropped silently: ``notes`` lists keys without
a meaning for serving, ``warnings`` sampling keys that no enabled plugin serves.

The defaults are built once at start-up, where the engine is built (``build_engine``), and
checked as request values are: a bad one is a ``GenerationConfigError`` naming the key and
its source. The process that accepts requests applies them (``apply``) before it validates,
so the engine and the plugins only ever see the effective values.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from freetoken_core.errors import FreeTokenError, InvalidRequest
from freetoken_core.sampling_params import DEFAULTABLE_FIELDS, SamplingParams

if TYPE_CHECKING:
    from freetoken_core.config import EngineConfig
    from freetoken_core.plugins import PluginManager
    from freetoken_core.processors import ModelInfo

FILE_NAME = "generation_config.json"
OVERRIDE_SOURCE = "--override-generation-config"

RENAMED = {"max_new_tokens": "max_tokens"}
"""Hugging Face keys whose FreeToken field has another name."""

NOT_FOR_SERVING = frozenset({
    # Token ids the tokenizer and the chat template already handle.
    "bos_token_id", "pad_token_id", "decoder_start_token_id",
    # Bookkeeping of transformers.
    "transformers_version", "_from_model_config", "_commit_hash", "use_cache",
    "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
    "output_hidden_states", "cache_implementation",
    # Sampling on or off: ignored as vLLM ignores it (temperature 0 is greedy).
    "do_sample",
    # A total-length limit (prompt included); requests bound max_tokens instead.
    "max_length",
    # Beam search and other decoding strategies this server does not run.
    "num_beams", "num_beam_groups", "early_stopping", "length_penalty",
    "num_return_sequences", "diversity_penalty", "penalty_alpha",
})
"""Keys of Hugging Face's ``GenerationConfig`` that have no meaning for serving: listed
once in the start-up log as not applied."""


class GenerationConfigError(FreeTokenError):
    """The generation config cannot be read, or one of its defaults is invalid."""


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The defaults in force, as the engine process hands them to the server (``Ready``).

    ``values``: field name → default value, checked at start-up; ``sources``: field name →
    where its value came from (a file path or ``--override-generation-config``);
    ``routes``: for a plugin field, the routes its plugin serves (the default applies to
    requests of those routes only); ``eos_token_ids``: the ids added to the model's EOS
    set; ``source``: one phrase saying where the defaults come from, or why there are none;
    ``notes``: keys not applied because they mean nothing to a server; ``warnings``: one
    message per sampling key that no enabled plugin serves."""

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    routes: dict[str, list[str]] = {}
    eos_token_ids: list[int] = []
    source: str = "none"
    notes: list[str] = []
    warnings: list[str] = []

    def apply(self, params: SamplingParams, route: str | None = None,
              fallback: Mapping[str, Any] | None = None) -> SamplingParams:
        """``params`` with each field it leaves unset taking its default: this object's,
        else ``fallback``'s (a route's own default, e.g. ``max_tokens``); plugin fields only
        on a ``route`` their plugin serves (``None``, offline: all)."""
        values = {name: value for name, value in self.values.items()
                  if route is None or name not in self.routes or route in self.routes[name]}
        return params.with_defaults({**(fallback or {}), **values})

    def summary(self) -> str:
        """The start-up log line: the effective defaults and their source."""
        if not self.values and not self.eos_token_ids:
            return f"generation defaults: none ({self.source})"
        shown = ", ".join(f"{k}={_show(v)}" for k, v in self.values.items())
        eos = f"; eos_token_id {self.eos_token_ids} (EOS ids)" if self.eos_token_ids else ""
        return f"generation defaults from {self.source}: {shown or 'no sampling field'}{eos}"

    def log(self, logger: logging.Logger) -> None:
        """The start-up lines: the summary, the keys not applied, one warning per key no
        enabled plugin serves."""
        logger.info("%s", self.summary())
        if self.notes:
            logger.info("generation config keys not applied (no meaning for serving): %s",
                        ", ".join(self.notes))
        for warning in self.warnings:
            logger.warning("%s", warning)


def read_sources(config: EngineConfig, model_dir: Path, is_gguf: bool
                 ) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The (source name, raw mapping) pairs ``config`` names, the file first, the override
    last; and, when no file applies, why (for the log)."""
    choice = str(config.generation_config)
    sources: list[tuple[str, dict[str, Any]]] = []
    why_none = None
    if choice == "none":
        why_none = "--generation-config none"
    elif choice == "auto":
        if is_gguf:
            why_none = "the model is a GGUF file, which has no generation_config.json"
        elif not (model_dir / FILE_NAME).is_file():
            why_none = f"the model directory {model_dir} has no {FILE_NAME}"
        else:
            sources.append(_read_file(model_dir / FILE_NAME))
    else:
        path = Path(choice).expanduser()
        if path.is_dir():
            path = path / FILE_NAME
        if not path.is_file():
            raise GenerationConfigError(f"--generation-config {choice}: no such file "
                                        f"({path}); give auto, none, a directory holding "
                                        f"{FILE_NAME}, or the file")
        sources.append(_read_file(path))
    if config.override_generation_config:
        sources.append((OVERRIDE_SOURCE, dict(config.override_generation_config)))
    return sources, why_none


def _read_file(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"cannot read the generation config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise GenerationConfigError(f"the generation config {path} is not a JSON object")
    return str(path), data


def merge(sources: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Keys renamed (``max_new_tokens`` → ``max_tokens``) and merged, later sources winning
    key by key; returns the values and each key's source."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, raw in sources:
        renamed: dict[str, Any] = {}
        for key, value in raw.items():
            name = RENAMED.get(key, key)
            if name in renamed and renamed[name] != value:
                raise GenerationConfigError(f"{source}: {key} and {name} disagree; give one")
            renamed[name] = value
        for name, value in renamed.items():
            values[name] = value
            origin[name] = source
    return values, origin


@dataclass(frozen=True)
class GenerationConfig:
    """The keys the sources hold, read and merged but not yet checked (``read``)."""

    values: dict[str, Any]
    origin: dict[str, str]
    """Each key's source: a file path or ``OVERRIDE_SOURCE``."""
    source_names: list[str]
    why_none: str | None
    """Why no file applies (``none``, a GGUF file, no file in the model directory)."""

    def eos_token_ids(self) -> set[int]:
        """The integer ids of ``eos_token_id`` (``resolve`` checks them against the
        vocabulary); the engine's limits need them before the plugins are checked."""
        return {t for t in _eos_list(self.values.get("eos_token_id"))
                if isinstance(t, int) and not isinstance(t, bool)}


def read(config: EngineConfig, model_dir: Path, is_gguf: bool) -> GenerationConfig:
    """Read and merge the sources ``config`` names for the model in ``model_dir``."""
    sources, why_none = read_sources(config, model_dir, is_gguf)
    values, origin = merge(sources)
    return GenerationConfig(values, origin, [name for name, _ in sources], why_none)


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def resolve(config: GenerationConfig, plugins: PluginManager,
            model: ModelInfo) -> GenerationDefaults:
    """The checked defaults for the served model; ``GenerationConfigError`` naming the key
    and its source for a value a request could not carry either."""
    raw, origin = config.values, config.origin
    owners = plugins.field_owners()
    classes = plugins.plugin_classes()
    values: dict[str, Any] = {}
    routes: dict[str, list[str]] = {}
    notes: list[str] = []
    warnings: list[str] = []
    eos: list[int] = []
    for name, value in raw.items():
        if value is None:
            continue  # null: unset (transformers writes some keys so)
        if name == "eos_token_id":
            eos = _eos_list(value)
            bad = [t for t in eos if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < model.vocab_size]
            if bad:
                raise GenerationConfigError(
                    f"eos_token_id from {origin[name]}: {bad[0]!r} is not a token id in "
                    f"[0, {model.vocab_size})")
        elif name in DEFAULTABLE_FIELDS:
            values[name] = value
        elif name in owners:
            values[name] = value
            served = classes[owners[name]].routes
            if served != {"chat", "completions"}:
                routes[name] = sorted(served)
        elif name in NOT_FOR_SERVING or name.startswith("_"):
            notes.append(name)
        else:
            warnings.append(f"generation config key {name}={_show(value)} from "
                            f"{origin[name]} is not applied: {_why_not(name, plugins)}")
    _check(values, origin, plugins, model)
    used = sorted({origin[name] for name in [*values, *(["eos_token_id"] if eos else [])]},
                  key=config.source_names.index)
    if used:
        source = " and ".join(used)
    elif config.source_names:
        source = f"{' and '.join(config.source_names)} sets no sampling field"
    else:
        source = config.why_none or "none"
    return GenerationDefaults(values=values, sources={k: origin[k] for k in values},
                              routes=routes, eos_token_ids=eos, source=source,
                              notes=notes, warnings=warnings)


def _show(value: Any) -> str:
    return json.dumps(value, default=repr)


def _why_not(name: str, plugins: PluginManager) -> str:
    """Why key ``name`` (neither a defaultable core field nor an enabled plugin's field)
    cannot be a default: the plugin to enable when an installed one owns it."""
    if name in SamplingParams.__dataclass_fields__:
        return "it is chosen per request and has no server default"
    try:
        plugins.require_field(name)
    except InvalidRequest as exc:
        return exc.message
    return "no enabled plugin serves it"


def _check(values: dict[str, Any], origin: dict[str, str], plugins: PluginManager,
           model: ModelInfo) -> None:
    """Validate ``values`` as a request carrying them would be; a default ``max_tokens``
    must also be at least 1 (0, which only scores a prompt, is a request's choice)."""
    if values.get("max_tokens") == 0:
        raise GenerationConfigError(
            f"invalid generation default max_tokens=0 from {origin['max_tokens']}: every "
            f"request would generate nothing; give at least 1")
    try:
        params = SamplingParams(**values)
        params.verify(model)
        plugins.validate(params, model)
    except FreeTokenError as exc:
        param = getattr(exc, "param", None) or ""
        key = next((k for k in values if param == k or param.startswith((f"{k}.", f"{k}["))),
                   None)
        message = getattr(exc, "message", str(exc))
        if key is None:
            raise GenerationConfigError(f"invalid generation defaults: {message}") from None
        raise GenerationConfigError(
            f"invalid generation default {key}={_show(values[key])} from {origin[key]}: "
            f"{message}") from None
