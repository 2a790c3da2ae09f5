"""The FreeToken plugin API: every hook a plugin may implement, in one place.

Plugins are modules (or objects) registered with pluggy under the project name
``freetoken`` and shipped as entry points in the ``freetoken.plugins`` group. Implement a
hook by defining a function of the same name decorated with ``freetoken_core.hookimpl``;
the arguments a hook receives are named below, and a hookimpl may accept any subset of
them. Unless said otherwise, every enabled plugin's implementation runs and the results
are collected in a list (pluggy's default); ``firstresult`` hooks stop at the first
non-``None`` result.

Errors: a hook that rejects a request raises ``freetoken_core.InvalidRequest(param,
message)``, which the server answers with HTTP 400 naming ``param``. Any other exception
is a bug in the plugin: it fails the requests that use the plugin (HTTP 500, code
``plugin_error``, naming the plugin and the hook), never the engine or the server
(``freetoken_core.faults``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    from freetoken_core.processors import LogitsProcessor, ModelInfo, StopView
    from freetoken_core.sampling_params import SamplingParams

PROJECT = "freetoken"
ENTRY_POINT_GROUP = "freetoken.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def freetoken_request_fields() -> list[str]:
    """The request fields this plugin owns, e.g. ``["presence_penalty", "frequency_penalty"]``.

    When: once, at start-up, in every process that validates requests. Return: a list of
    field names (JSON names on the server, keyword names of ``SamplingParams`` offline).
    A field that no installed plugin owns is rejected; a field whose plugin is installed
    but not enabled is rejected with a message naming the plugin to enable. Two enabled
    plugins may not own the same field (start-up error). Raises: nothing.
    """


@hookspec
def freetoken_register_processors(register: Callable[[type[LogitsProcessor]], None]) -> None:
    """Hand logits-processor classes to the engine: call ``register(cls)`` for each.

    When: once, at engine start, in the engine process. ``cls`` subclasses
    ``freetoken_core.processors.LogitsProcessor``; the core checks it (a unique ``name``,
    a known ``stage``) and raises ``ValueError`` at start-up otherwise. The engine builds
    one instance per class, which keeps per-slot state for every running sequence.
    Return: nothing.
    """


@hookspec
def freetoken_validate_request(request: SamplingParams, model: ModelInfo) -> None:
    """Check the fields this plugin owns on one request, before it is queued.

    When: per request, in the process that accepts it (the server process under
    ``freetoken serve``, the caller's under ``LLM.generate``), after the core fields were
    checked. ``request`` is the ``SamplingParams``; plugin fields are in
    ``request.extra`` (and readable as attributes). ``model`` holds ``vocab_size``,
    ``eos_token_ids`` and ``max_model_len``. A plugin may normalise its own fields in
    ``request.extra`` (e.g. clamp values). Return: nothing. Raises: ``InvalidRequest``
    naming the field.
    """


@hookspec(firstresult=True)
def freetoken_rewrite_prompt(request: Any, prompt: str | list[int], tokenizer: Any
                             ) -> str | list[int] | None:
    """Rewrite a prompt before tokenization, e.g. lay out prefix and suffix for FIM.

    When: per request, in the server process, after validation. ``firstresult``: the
    first plugin that returns a non-``None`` prompt wins. Return: the new prompt (text or
    token ids) or ``None`` to leave it. Raises: ``InvalidRequest`` (e.g. the model has no
    FIM tokens).
    """


@hookspec
def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]
                         ) -> dict[int, int | str] | None:
    """Token-level stop rules beyond EOS and ``max_tokens``, for a whole step at once.

    When: every engine step, in the engine process, after sampling, with the rows that
    drew a token. ``sequences[i]`` drew ``token_ids[i]``; a ``StopView`` has ``params``,
    ``num_output_tokens`` and ``output_token_ids``. Called per plugin, with only the
    rows whose request uses one of this plugin's fields. Return: ``{row: stop_reason}``
    for the rows that must stop now (the reason is reported as ``stop_reason``), or
    ``None``. Raises: nothing (the request was validated before; an exception fails
    exactly these rows' requests).
    """


@hookspec
def freetoken_decorate_response(request: Any, response: Any, output: Any) -> None:
    """Add to a response or stream chunk before it is sent, in place.

    When: per response and per stream chunk (usage chunk included), in the server
    process. ``request`` is the parsed HTTP request, ``response`` the response object about
    to be encoded, ``output`` the server's ``Generation`` of the request (``tokenizer``,
    ``prompts``, ``params``, ``token_ids(index)``, and ``plugin_state``, a dict for
    per-request state under the plugin's name). Return: nothing. Raises: nothing (an
    exception after a stream began becomes its one error event).
    """


@hookspec
def freetoken_add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add this plugin's own command-line options to ``freetoken serve``/``generate``.

    When: at start-up, before arguments are parsed, for installed plugins. Return:
    nothing. Raises: nothing.
    """


@hookspec
def freetoken_configure(config: dict[str, Any]) -> None:
    """Receive the parsed options (``vars(args)``) once they are known.

    When: at start-up, after parsing, in every process that loads plugins. Return:
    nothing. Raises: ``ValueError`` for an option value the plugin cannot use.
    """
