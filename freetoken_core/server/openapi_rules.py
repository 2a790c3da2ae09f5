"""The request rules the server enforces beyond the Structs' types, stated in the OpenAPI
document: ranges, shapes, lengths and the cross-field rules JSON Schema can express
(``allOf`` of ``if``/``then`` and ``not``), and, for what it cannot (a prompt that must fit
the context, a template that refuses a role), a ``description`` and the vendor extension
``x-freetoken-checks`` on the field that a 400 names: a list of the rules the server checks
there beyond its schema. A schema-valid request is refused only by such a rule.

At most five conditionals (``if``/``then``, ``not``) go into one schema: schemathesis
cannot generate data for more (``test_openapi`` holds it).

``add_request_rules`` runs when the app is built (the limits are known then);
``add_model_rules`` when the model has loaded (vocabulary and context).
"""

from __future__ import annotations

from typing import Any

from freetoken_core.processors import ModelInfo
from freetoken_core.sampling_params import INT64_MAX
from freetoken_core.server.limits import RequestLimits
from freetoken_core.server.serving import RESERVED_TEMPLATE_KWARGS

CHECKS = "x-freetoken-checks"
"""The vendor extension listing a field's rules beyond its schema."""

_GENERATION = ("CompletionRequest", "ChatCompletionRequest")
_NULL = {"type": "null"}
_CONTINUE = "needs the last message to be the assistant's"
_CONTEXT = ("the prompt plus max_tokens must fit the model's context (400 code "
            "context_length_exceeded)")


def checks(schema: dict[str, Any], *rules: str) -> None:
    """Add ``rules`` to the ``x-freetoken-checks`` of the property schema ``schema``."""
    schema.setdefault(CHECKS, []).extend(rules)


def _set_when(name: str, then: dict[str, Any]) -> dict[str, Any]:
    """``if`` property ``name`` is present and not null ``then`` ``then``."""
    return {"if": {"required": [name], "properties": {name: {"not": _NULL}}}, "then": then}


def _true_when(name: str) -> dict[str, Any]:
    return {"required": [name], "properties": {name: {"const": True}}}


def add_request_rules(schemas: dict[str, Any], limits: RequestLimits) -> None:
    """State in the body schemas (msgspec's, by component name) the rules the routes check
    that need no model: see the module docstring."""
    stop_text = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_string_chars}
    for name in _GENERATION:
        schema = schemas[name]
        props = schema["properties"]
        props["top_k"] = {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1,
                                                    "maximum": INT64_MAX}, _NULL],
                          "description": "-1 (off) or at least 1, at most the vocabulary "
                                         "size."}
        props["stop"] = {"anyOf": [stop_text, {"type": "array", "items": stop_text,
                                               "maxItems": limits.max_stop_strings}, _NULL]}
        props["cache_salt"] = {"anyOf": [{"type": "string", "minLength": 1,
                                          "maxLength": limits.max_cache_salt_chars}, _NULL]}
        for field in ("max_tokens", "max_completion_tokens"):
            props[field]["description"] = (
                "0 only to score the prompt; max_tokens and max_completion_tokens are one "
                "field (both given: the same value).")
            checks(props[field], _CONTEXT, "0 generates nothing: only with prompt_logprobs "
                   "(or echo on /v1/completions)", "max_tokens and max_completion_tokens "
                   "given together must be equal")
        # Five conditionals at most in one schema: schemathesis (hypothesis-jsonschema)
        # cannot generate data for more; the rarer rules are stated as checks.
        schema.setdefault("allOf", []).append(_set_when("stream_options", _true_when("stream")))
        checks(props["prompt_logprobs"], "not with stream: true")
    _completion_rules(schemas["CompletionRequest"], limits)
    _chat_rules(schemas["ChatCompletionRequest"], schemas["ChatMessage"])
    tokenize = schemas["TokenizeRequest"]
    tokenize["oneOf"] = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                         {"required": ["messages"],
                          "properties": {"messages": {"type": "array"}}}]
    tokenize["description"] = "Exactly one of prompt and messages."
    tokenize.setdefault("allOf", []).append(_no_continue_and_generation_prompt())
    _template_kwargs(tokenize["properties"])
    checks(tokenize["properties"]["messages"], "the chat template may refuse the messages "
           "(a role it does not know, an order it does not accept)")
    checks(tokenize["properties"]["continue_final_message"], _CONTINUE)
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["minimum"] = 0


def _completion_rules(schema: dict[str, Any], limits: RequestLimits) -> None:
    props = schema["properties"]
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    props["prompt"] = {
        "anyOf": [text, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                         "items": text},
                  ids, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                        "items": ids}],
        "description": "A text, a list of texts, a list of token ids or a list of lists of "
                       "token ids; ids below the vocabulary size."}
    checks(props["prompt"], _CONTEXT, f"at most {limits.max_prompt_chars:,} characters of "
           f"text and {limits.max_sequences:,} prompts x n")
    props["top_logprobs"] = {**_NULL, "description": "A chat field: use logprobs here."}
    props["best_of"] = {"anyOf": [{"const": 1}, _NULL],
                        "description": "Only 1: n choices with logprobs do the same."}


def _chat_rules(schema: dict[str, Any], message: dict[str, Any]) -> None:
    props = schema["properties"]
    schema.setdefault("allOf", []).extend([
        _set_when("top_logprobs", _true_when("logprobs")),
        _no_continue_and_generation_prompt()])
    props["top_logprobs"]["description"] = "Needs logprobs: true."
    _template_kwargs(props)
    checks(props["messages"], "the chat template may refuse the messages (a role it does not "
           "know, an order it does not accept)")
    checks(props["continue_final_message"], _CONTINUE)
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message["properties"]["content"] = {
        "anyOf": [{"type": "string"}, {"type": "array", "items": part}, _NULL],
        "description": "A text, or a list of text parts."}


def _no_continue_and_generation_prompt() -> dict[str, Any]:
    """continue_final_message: true needs add_generation_prompt: false (its default is
    true)."""
    return {"if": _true_when("continue_final_message"),
            "then": {"required": ["add_generation_prompt"],
                     "properties": {"add_generation_prompt": {"const": False}}}}


def _template_kwargs(props: dict[str, Any]) -> None:
    kwargs = props["chat_template_kwargs"]
    for branch in kwargs.get("anyOf", [kwargs]):
        if branch.get("type") == "object":
            branch["propertyNames"] = {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}
    kwargs["description"] = ("Template variables; not the keys that steer the rendering, "
                             "nor a request field's name.")
    checks(kwargs, "a key that is a request field of an enabled plugin is refused")


def add_model_rules(schemas: dict[str, Any], model: ModelInfo) -> None:
    """State the rules that depend on the loaded model: token ids below its vocabulary,
    ``top_k`` at most its size, ``max_tokens`` below its context."""
    largest = model.vocab_size - 1
    for name in _GENERATION:
        props = schemas[name]["properties"]
        props["top_k"]["anyOf"][1]["maximum"] = model.vocab_size
        for field in ("max_tokens", "max_completion_tokens"):
            props[field]["anyOf"][0]["maximum"] = model.max_model_len - 1
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    prompt[2]["items"]["maximum"] = largest
    prompt[3]["items"]["items"]["maximum"] = largest
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = largest
