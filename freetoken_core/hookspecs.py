"""The FreeToken plugin hooks: what a plugin does that is not a logits processor.

A plugin is one class (``freetoken_core.Plugin``, or ``freetoken_core.LogitsProcessor``
for a processor; see ``freetoken_core.processors``). Its request fields, validation and
per-slot state live on the class. Everything else is a hook: a static or class method of
the plugin class with one of the names below, marked ``@hookimpl``. The arguments a hook
receives are named below, and an implementation may accept any subset of them. Unless said
otherwise, every enabled plugin's implementation runs and the results are collected in a
list (pluggy's default); ``firstresult`` hooks stop at the first non-``None`` result.

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

    from freetoken_core.processors import (
        AnswerStart,
        ChatView,
        PromptView,
        RequestView,
        ResponseView,
        StopView,
    )

PROJECT = "freetoken"
ENTRY_POINT_GROUP = "freetoken.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def freetoken_rewrite_prompt(prompt: PromptView) -> str | list[int] | None:
    """Rewrite a completions prompt before tokenization, e.g. lay the prompt and a
    plugin's own request field out with the model's special tokens.

    When: per prompt of a ``/v1/completions`` request, in the server process (offline: in
    ``LLM.generate``), after validation, in a worker thread. ``prompt.params.fields`` holds
    the validated fields of the plugins the request uses. ``firstresult``: the first plugin
    that returns a non-``None`` prompt wins. Return: the new prompt (text or token ids) or
    ``None`` to leave it. Raises: ``InvalidRequest`` (e.g. the model lacks a token the
    layout needs).
    """


@hookspec
def freetoken_chat_template(chat: ChatView) -> None:
    """Adapt a chat request's messages and template variables before the model's chat
    template renders them, in place: give the template a variable it reads, or spell out
    for a template that lacks one what it cannot render.

    When: per chat request (and ``/tokenize`` with ``messages``, where ``chat.params`` is
    ``None``), in the server process (offline: never, as ``LLM`` takes prompts), in a
    worker thread, after validation and before the template. Every enabled plugin runs;
    it may also change ``chat.params`` (the request about to run), e.g. keep the special
    tokens its markup is made of. Return: nothing. Raises: ``InvalidRequest`` naming the
    message field at fault, or the request field the template cannot honour.
    """


@hookspec
def freetoken_check_stop(sequences: list[StopView], token_ids: list[int]
                         ) -> dict[int, int | str] | None:
    """Token-level stop rules beyond EOS and ``max_tokens``, for a whole step at once.

    When: every engine step, in the engine process, after sampling, with only the rows
    whose request uses this plugin (its name is in ``params.fields``). ``sequences[i]``
    drew ``token_ids[i]``; a ``StopView`` has ``params``, ``fields`` (this plugin's),
    ``num_output_tokens`` and ``output_token_ids``. Return: ``{row: stop_reason}`` for the
    rows that must stop now (the reason is reported as ``stop_reason``), or ``None``.
    Raises: nothing (an exception fails exactly these rows' requests).
    """


@hookspec(firstresult=True)
def freetoken_answer_start(request: RequestView, tokenizer: Any) -> AnswerStart | None:
    """Where the answer of a sequence starts, for plugins that act on the answer only (a
    grammar constrains the answer, not a thinking preamble before it).

    When: in the engine process, when a sequence of a request that uses a plugin which
    asks is added. ``firstresult``. Return: an ``AnswerStart``
    (the token that ends a preamble, whether the prompt left one open, the token that may
    open one) or ``None`` when the answer starts at the first generated token. Raises:
    nothing.
    """


@hookspec
def freetoken_decorate_response(response: ResponseView) -> None:
    """Change a response or stream chunk before it is sent, in place.

    When: per response and per stream chunk (the opening and usage chunks included), in
    the server process. ``response`` is a ``ResponseView``: assign a choice's ``text``, set
    the plugin's ``MessageFields`` on ``choice.message`` and its ``UsageFields`` on
    ``response.usage``. Return: nothing. Raises: nothing (an exception after a stream began
    becomes its one error event).
    """


@hookspec
def freetoken_add_cli_options(parser: argparse._ArgumentGroup) -> None:
    """Add this plugin's own options to ``freetoken serve`` / ``generate`` / ``bench``.

    When: at start-up, before the arguments are parsed, for every installed plugin;
    ``parser`` is an argument group named after the plugin. Use option names that start
    with the plugin's name (``--my-plugin-backend`` for ``my_plugin``). The parsed values reach a
    processor as ``ProcessorContext.options`` and every plugin through
    ``freetoken_configure``. Return: nothing. Raises: nothing.
    """


@hookspec
def freetoken_configure(options: dict[str, Any]) -> None:
    """Receive the parsed options (``vars(args)``; ``{}`` offline) once plugins are loaded.

    When: once per process that loads plugins (the server and the engine process), for
    enabled plugins. Return: nothing. Raises: ``ValueError`` for an option value the
    plugin cannot use (a start-up error).
    """
