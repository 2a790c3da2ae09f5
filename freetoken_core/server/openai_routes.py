"""The two generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``:
request → prompts and ``SamplingParams`` → one ``Generation`` → a JSON body or an SSE
stream. Every failure before the first byte is an exception the app renders as an
OpenAI error; after it, one ``data: {"error": …}`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.response import Stream

from freetoken_core.engine.carry import check_carryable
from freetoken_core.engine.output_processor import StopMatcher
from freetoken_core.errors import FreeTokenError
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ChoiceView, PromptView, ResponseView
from freetoken_core.server import protocol as p
from freetoken_core.server.generation import ChoiceDelta, Generation, LogprobEntry
from freetoken_core.server.limits import count_prompts
from freetoken_core.server.logprobs import LogprobFormatter, echo_entries
from freetoken_core.server.serving import (
    check_fits,
    completion_prompts,
    parse_body,
    render_chat,
    sampling_params,
)
from freetoken_core.server.state import ApiError, Serving, error_of

log = logging.getLogger("freetoken.server")

T = TypeVar("T")


_SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive",
                "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"


class _EventStream(Stream):
    """A ``Stream`` labelled ``text/event-stream``: Litestar hands the route handler's media
    type (JSON, the default of a handler that may also return a JSON body) to
    ``to_asgi_response``, where it would win over the response's own and label the events
    ``application/json`` (which SSE clients such as httpx-sse refuse)."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("media_type", None)
        return super().to_asgi_response(*args, **kwargs)


def _sse(data: msgspec.Struct) -> bytes:
    """One server-sent event: JSON has no raw line break, so one ``data:`` line."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


async def _stream(gen: Generation, first: Any, deltas: AsyncIterator[Any],
                  chunk: Callable[[list[Any], p.Usage | None], msgspec.Struct],
                  choice: Callable[[Any], Any], include_usage: bool,
                  opening: list[Any], usage_cls: type[p.Usage]) -> AsyncIterator[bytes]:
    """The SSE body; ``deltas`` is closed (and the engine request aborted) on disconnect."""
    try:
        if opening:
            yield _sse(chunk(opening, None))
        if first is not None:
            yield _sse(chunk([choice(first)], None))
        async for delta in deltas:
            yield _sse(chunk([choice(delta)], None))
        if include_usage:
            yield _sse(chunk([], gen.usage(usage_cls)))
    except FreeTokenError as exc:
        yield _sse(p.ErrorResponse(error_of(exc)[1]))
    except Exception as exc:  # a bug past the first byte: still one error event and [DONE]
        log.exception("internal error while streaming", exc_info=exc)
        yield _sse(p.ErrorResponse(p.ErrorBody(f"internal error: {type(exc).__name__}",
                                               "internal_error")))
    finally:
        await deltas.aclose()
    yield _DONE


async def _until_disconnect(request: Request) -> None:
    """Return when the client has gone away. Only for after the body was read: from
    then on the server's next ASGI message for this request is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, but if the client disconnects first, cancel it (closing the engine
    stream, which aborts every sequence of the request and frees their KV blocks) and
    raise ``ApiError(499)``, which nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the request", "client_closed_request")
    return task.result()


def _decorate(plugins: PluginManager, response: Any, gen: Generation, chat: bool,
              is_chunk: bool) -> None:
    """Run ``freetoken_decorate_response`` on a ``ResponseView`` of ``response`` (a
    response or a stream chunk), then write the choices' ``text`` back."""
    if chat:
        views = [ChoiceView(c.index, c.delta.content if is_chunk else c.message.content,
                            c.finish_reason, c.delta if is_chunk else c.message)
                 for c in response.choices]
    else:
        views = [ChoiceView(c.index, c.text, c.finish_reason, None) for c in response.choices]
    plugins.decorate_response(ResponseView(
        "chat" if chat else "completions", is_chunk, views, response.usage, gen.params,
        gen.prompts, gen.tokenizer, gen.token_ids, gen.plugin_state))
    for view, c in zip(views, response.choices):
        c.finish_reason = view.finish_reason
        if not chat:
            c.text = view.text or ""
        elif is_chunk:
            c.delta.content = view.text
        else:
            c.message.content = view.text


def _prompt_texts(tokenizer: Any, prompt: str | list[Any],
                  prompts: list[list[int]]) -> list[str]:
    """The text ``echo`` puts first: the prompt as sent, or its ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    return [tokenizer.decode(ids) for ids in prompts]


async def run_generation(serving: Serving, request: Request, chat: bool) -> Any:
    """Serve one generation request; the response object or a ``Stream`` of events."""
    cls = p.ChatCompletionRequest if chat else p.CompletionRequest
    body, extra, message_extras = parse_body(await request.body(), cls)
    tokenizer, plugins, model_info = serving.require_ready(body.model)
    limits, pool = serving.config.limits, serving.tokenizer_pool
    limits.check_stop(body.stop)
    limits.check_cache_salt(body.cache_salt)
    params = sampling_params(body, extra, plugins, model_info, serving.generation_defaults)
    # Templates, tokenization and the rewrite hook run in worker threads (``pool``), so a
    # long prompt never stalls the streams this event loop serves.
    if isinstance(body, p.ChatCompletionRequest):
        limits.check_sequences(1, params.n)
        limits.check_messages(body.messages)

        def chat_prompts() -> list[list[int]]:
            text = render_chat(tokenizer, body.messages,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs,
                               plugins=plugins, params=params, extras=message_extras)
            limits.check_prompt_chars(len(text), "messages")
            return [pool.encode(tokenizer, text)]

        prompts = await pool.run(chat_prompts)
    else:
        num_prompts, num_chars = count_prompts(body.prompt)
        # Text a plugin may lay out around the prompt counts as prompt text.
        num_chars += sum(len(v) for v in params.extra.values() if isinstance(v, str))
        limits.check_sequences(num_prompts, params.n)
        limits.check_prompt_chars(num_chars, "prompt")

        def rewrite(prompt: str | list[int]) -> str | list[int]:
            return plugins.rewrite_prompt(PromptView(prompt, params, tokenizer))

        prompts = await pool.run(completion_prompts, body.prompt, rewrite,
                                 partial(pool.encode, tokenizer,
                                         add_special_tokens=body.add_special_tokens))
    await pool.run(check_fits, prompts, params, model_info, "messages" if chat else "prompt")
    check_carryable(params)  # what the engine message cannot carry: a 400 naming where
    if params.prompt_logprobs is not None:
        limits.check_prompt_logprobs(
            sum(map(len, prompts)), params.n, params.prompt_logprobs,
            "logprobs" if body.prompt_logprobs is None else "prompt_logprobs")
    gen = Generation(serving.client, tokenizer, prompts, params,
                     on_done=serving.metrics.record, is_chat=chat,
                     matcher=await pool.run(StopMatcher, params.stop))
    if isinstance(body, p.ChatCompletionRequest) and body.request_id is not None:
        rid = body.request_id
    else:
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
    created, name = int(time.time()), serving.config.model_name
    fmt = LogprobFormatter(tokenizer)
    echoes: list[str] = []
    if isinstance(body, p.CompletionRequest) and body.echo:
        echoes = [t for t in await pool.run(_prompt_texts, tokenizer, body.prompt, prompts)
                  for _ in range(params.n)]
    # With echo and logprobs the prompt's tokens lead each choice's logprobs, from the
    # prompt logprobs that come with the first update of its prompt (before any delta).
    echo_num_top = body.logprobs if echoes and body.logprobs is not None else None
    echoed: set[int] = set()

    def echo_entries_of(index: int) -> list[LogprobEntry]:
        prompt_index = index // params.n
        return echo_entries(prompts[prompt_index], gen.prompt_logprobs(prompt_index),
                            echo_num_top)

    def prompt_logprobs_of(prompt_index: int) -> p.PromptLogprobsList:
        return fmt.prompt(prompts[prompt_index], gen.prompt_logprobs(prompt_index),
                          body.prompt_logprobs)
    types = serving.response_types
    decorates = plugins.decorates_responses()

    def decorated(response: Any, is_chunk: bool = True) -> Any:
        if decorates:
            _decorate(plugins, response, gen, chat, is_chunk)
        return response

    if chat:
        def chunk(choices: list[Any], usage: p.Usage | None) -> msgspec.Struct:
            return decorated(p.ChatCompletionChunk(rid, created, name, choices, usage))

        def choice(d: ChoiceDelta) -> Any:
            return p.ChatChunkChoice(d.index, types.delta(content=d.text), d.finish_reason,
                                     d.stop_reason,
                                     None if d.logprobs is None else fmt.chat(d.logprobs))
    else:
        def chunk(choices: list[Any], usage: p.Usage | None) -> msgspec.Struct:
            return decorated(p.CompletionResponse(rid, created, name, choices, usage))

        def choice(d: ChoiceDelta) -> Any:
            text, entries = d.text, d.logprobs
            if echo_num_top is not None and d.index not in echoed:  # echo in its first chunk
                echoed.add(d.index)
                text, entries = echoes[d.index] + text, echo_entries_of(d.index) + entries
            return p.CompletionChoice(
                d.index, text, d.finish_reason, d.stop_reason,
                None if entries is None else fmt.completion(d.index, entries))

    deltas = gen.deltas()
    if body.stream:
        # The first delta is awaited here so that an engine refusal is still a plain 400;
        # a client that leaves meanwhile (a long prefill) aborts the request at once.
        try:
            first = await _unless_disconnected(request, deltas.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise
        num_choices = len(prompts) * params.n
        if chat:
            opening = [p.ChatChunkChoice(i, types.delta(role="assistant", content=""))
                       for i in range(num_choices)]
        else:
            opening = [p.CompletionChoice(i, text) for i, text in enumerate(echoes)
                       if echo_num_top is None]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # Events framed here, as bytes: Litestar's ServerSentEvent frames each one through
        # a dataclass, a StringIO and a regex (with the direct detokenizer, this took the
        # server process's CPU per streamed token from ~0.40 to ~0.32 ms at 32 clients).
        return _EventStream(_stream(gen, first, deltas, chunk, choice, include_usage,
                                    opening, types.usage),
                            media_type="text/event-stream", headers=_SSE_HEADERS)
    async def drain() -> None:
        async for _ in deltas:
            pass

    await _unless_disconnected(request, drain())
    finishes, logprobs = gen.finishes(), gen.logprobs()
    if chat:
        choices = [p.ChatChoice(i, types.message(t), *finishes[i],
                                None if logprobs[i] is None else fmt.chat(logprobs[i]))
                   for i, t in enumerate(gen.texts())]
        response = p.ChatCompletionResponse(rid, created, name, choices,
                                            gen.usage(types.usage))
        if body.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_of(0)
        return decorated(response, is_chunk=False)
    texts = gen.texts()
    if echoes:
        texts = [e + t for e, t in zip(echoes, texts)]
    if echo_num_top is not None:
        logprobs = [echo_entries_of(i) + (entries or []) for i, entries in enumerate(logprobs)]
    choices = [p.CompletionChoice(i, t, *finishes[i],
                                  None if logprobs[i] is None else fmt.completion(i, logprobs[i]))
               for i, t in enumerate(texts)]
    if body.prompt_logprobs is not None:
        scored = [prompt_logprobs_of(i) for i in range(len(prompts))]
        for c in choices:
            c.prompt_logprobs = scored[c.index // params.n]
    return decorated(p.CompletionResponse(rid, created, name, choices,
                                          gen.usage(types.usage)), is_chunk=False)
