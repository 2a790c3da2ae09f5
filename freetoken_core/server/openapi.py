"""The served OpenAPI document (``GET /schema/openapi.json``) and its Swagger UI
(``/schema``, ``/schema/swagger``).

Litestar derives the document from the routes, but the generation, tokenize and
detokenize routes read their raw body (``parse_body`` names the bad field in the 400 and
keeps undeclared fields as plugin fields), so Litestar sees no body type there.
``complete_document`` adds what it cannot see, once, when the app is built:

- each body route's request body and its 200 body: msgspec's JSON Schema of the
  ``protocol`` Structs, and every rule the routes check beyond the types
  (``openapi_rules``: ranges, shapes, cross-field ``if``/``then``, and
  ``x-freetoken-checks`` where JSON Schema cannot say it); the generation routes answer
  ``text/event-stream`` as well when ``stream`` is true, its schema that of one event (the
  3.1 convention; OpenAPI 3.2's ``itemSchema``);
- the request fields the enabled plugins own, with the JSON Schema of their types (each
  plugin's ``Fields``), on the routes the plugin serves, each described by the plugin's own
  text (the field's docstring, else the plugin's) and marked as checked by the plugin,
  and the chat message keys they own (``ChatMessageFields``),
  and the accepted-without-effect ``IGNORED_FIELDS``; any other field is a 400, so the generation
  requests are closed (``additionalProperties: false``);
- ``model`` as the one name served (another is a 404);
- the OpenAI error answers (``ErrorResponse``) of every route, and under ``--api-key`` the
  bearer scheme and the 401 on every route but ``/health``.

The document is rendered afresh on each request (``FreshJsonRender``), so the model's own
bounds (``openapi_rules.add_model_rules``, once it has loaded) show in it.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.openapi.spec import (
    OpenAPI,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Reference,
    RequestBody,
    SecurityScheme,
)

from freetoken_core.processors import Plugin
from freetoken_core.server import protocol as p
from freetoken_core.server.limits import RequestLimits
from freetoken_core.server.openapi_rules import add_request_rules, checks

SCHEMA_PATH = "/schema"
"""Where the document and the Swagger UI are served (``openapi.json``, ``swagger``)."""

SECURITY_SCHEME = "bearer"
_REF = "#/components/schemas/{name}"

ERROR_DESCRIPTIONS = {
    400: "Invalid request: the error's ``param`` names the field.",
    401: "No valid API key (``Authorization: Bearer <key>``).",
    404: "Unknown model (``code: model_not_found``) or route.",
    413: "The request is too large.",
    500: "A plugin or the engine failed this request (``code``: ``plugin_error`` or "
         "``engine_error``; the message names the plugin and the stage).",
    503: "The model is still loading, or the engine process is restarting (see "
         "``Retry-After``).",
}


@dataclass(frozen=True)
class RouteBodies:
    """What one route reads and answers beyond what Litestar derives; ``errors`` are the
    statuses it can answer with an ``ErrorResponse`` (401 is added under ``--api-key``)."""

    request: type[msgspec.Struct] | None = None
    response: type[msgspec.Struct] | None = None
    stream_chunk: type[msgspec.Struct] | None = None
    """The Struct of each ``data:`` event when ``stream`` is true."""
    errors: tuple[int, ...] = (503,)


_BODY_ERRORS = (400, 404, 413, 503)
_GENERATION_ERRORS = (400, 404, 413, 500, 503)
"""The generation routes also answer 500 when a plugin or the engine fails the request."""
_TOKENIZE = RouteBodies(p.TokenizeRequest, p.TokenizeResponse, errors=_BODY_ERRORS)
_DETOKENIZE = RouteBodies(p.DetokenizeRequest, p.DetokenizeResponse, errors=_BODY_ERRORS)

ROUTES: dict[tuple[str, str], RouteBodies] = {
    ("post", "/v1/completions"): RouteBodies(
        p.CompletionRequest, p.CompletionResponse, p.CompletionResponse, _GENERATION_ERRORS),
    ("post", "/v1/chat/completions"): RouteBodies(
        p.ChatCompletionRequest, p.ChatCompletionResponse, p.ChatCompletionChunk,
        _GENERATION_ERRORS),
    ("post", "/tokenize"): _TOKENIZE,
    ("post", "/v1/tokenize"): _TOKENIZE,
    ("post", "/detokenize"): _DETOKENIZE,
    ("post", "/v1/detokenize"): _DETOKENIZE,
    ("get", "/v1/models"): RouteBodies(),
    ("get", "/v1/models/{model_id}"): RouteBodies(errors=(404, 503)),
    ("get", "/internal/stats"): RouteBodies(),
    ("get", "/metrics"): RouteBodies(errors=()),  # served while the engine is down too
    ("get", "/health"): RouteBodies(),
    ("get", "/version"): RouteBodies(errors=()),
}
"""Every served (method, path); ``complete_document`` fails on a route missing here."""

_OK_RESPONSES = {
    "/health": OpenAPIResponse(description="The model is loaded (an empty body)."),
    "/metrics": OpenAPIResponse(
        description="Prometheus text format 0.0.4.",
        content={"text/plain": OpenAPIMediaType(schema={"type": "string"})}),  # type: ignore[arg-type]
}
"""200 answers that are not a JSON Struct."""

_OWNED = "(Owned by the plugin `{plugin}`.)"
_SET_BY = "(Set by the plugin `{plugin}`; absent otherwise.)"
_PLUGIN_FIELD_REQUESTS = {p.CompletionRequest: "completions", p.ChatCompletionRequest: "chat"}
_MODEL_REQUESTS = (p.CompletionRequest, p.ChatCompletionRequest, p.TokenizeRequest,
                   p.DetokenizeRequest)


class FreshJsonRender(JsonRenderPlugin):
    """``/schema/openapi.json`` rendered from the app's document on every request (Litestar
    caches the first rendering; the model's bounds are added after the model loads)."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return self.render_json(request, request.app.openapi_schema.to_schema())


def openapi_config(version: str) -> OpenAPIConfig:
    """The JSON document at ``/schema/openapi.json`` and Swagger UI at ``/schema`` and
    ``/schema/swagger``; no other documentation site."""
    return OpenAPIConfig(
        title="FreeToken", version=version, path=SCHEMA_PATH,
        description="An OpenAI-compatible inference server (see docs/openai_api.md).",
        render_plugins=[SwaggerRenderPlugin(), FreshJsonRender()])


def _content(schema: dict[str, Any] | Reference) -> dict[str, OpenAPIMediaType]:
    return {"application/json": OpenAPIMediaType(schema=schema)}  # type: ignore[arg-type]


def _ref(cls: type) -> Reference:
    return Reference(ref=_REF.format(name=cls.__name__))


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``'s own body (as Sphinx reads
    them), whitespace folded; empty when its source is not available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _plugin_properties(fields_cls: type[msgspec.Struct], components: dict[str, Any],
                       plugin: str, plugin_cls: type, note: str) -> dict[str, Any]:
    """The JSON Schema of each field of a plugin's ``fields_cls`` (``Fields``,
    ``MessageFields``, ``UsageFields``, ``ChatMessageFields``), each described by the
    plugin's own text (the field's docstring, else the plugin's first docstring line)
    followed by ``note``; the structs its types use are added to ``components``."""
    (ref,), found = msgspec.json.schema_components([fields_cls], ref_template=_REF)
    own = found.pop(ref["$ref"].rsplit("/", 1)[-1])
    components.update(found)
    docs = field_docstrings(fields_cls)
    summary = ((inspect.getdoc(plugin_cls) or "").strip().splitlines() or [""])[0]
    properties = {}
    for name, schema in own.get("properties", {}).items():
        text = docs.get(name) or schema.get("description") or summary
        described = f"{text} {note.format(plugin=plugin)}".strip()
        properties[name] = {**schema, "description": described}
    return properties


def _request_schemas(model_name: str, plugins: dict[str, type[Plugin]],
                     limits: RequestLimits) -> dict[str, Any]:
    """msgspec's component schemas of every body Struct, completed as the module says;
    ``plugins``: the enabled plugin classes by name."""
    structs = {cls for bodies in ROUTES.values()
               for cls in (bodies.request, bodies.response, bodies.stream_chunk) if cls}
    _, components = msgspec.json.schema_components(
        sorted([*structs, p.ErrorResponse], key=lambda c: c.__name__), ref_template=_REF)
    for cls in _MODEL_REQUESTS:
        components[cls.__name__]["properties"]["model"] = {
            "enum": [model_name, None], "default": None,
            "description": "The served model (another name is a 404); null means it."}
    add_request_rules(components, limits)
    owned = {name: (cls, _plugin_properties(cls.Fields, components, name, cls, _OWNED))
             for name, cls in sorted(plugins.items()) if cls.Fields is not None}
    for request_cls, route in _PLUGIN_FIELD_REQUESTS.items():
        schema = components[request_cls.__name__]
        properties = schema["properties"]
        for name in sorted(p.IGNORED_FIELDS):
            properties.setdefault(name, {"description": "Accepted, without effect."})
        for plugin, (cls, fields) in owned.items():
            if route not in cls.routes:
                continue
            schema.setdefault("allOf", []).extend(cls.request_rules)
            for field_name, field_schema in fields.items():
                properties[field_name] = dict(field_schema)
                checks(properties[field_name], f"validated by the plugin `{plugin}`")
        # Any other field is a 400 naming it (PluginManager.require_field).
        schema["additionalProperties"] = False
    message = components[p.ChatMessage.__name__]
    for name, cls in sorted(plugins.items()):
        if cls.ChatMessageFields is None:
            continue
        for field_name, field_schema in _plugin_properties(
                cls.ChatMessageFields, components, name, cls, _OWNED).items():
            message["properties"][field_name] = field_schema
            checks(field_schema, f"validated by the plugin `{name}`")
    message["additionalProperties"] = False  # another key is a 400 naming it
    for name, cls in sorted(plugins.items()):
        for attr, targets in (("MessageFields", (p.ResponseMessage, p.DeltaMessage)),
                              ("UsageFields", (p.Usage,))):
            fields_cls = getattr(cls, attr)
            if fields_cls is None:
                continue
            for field_name, field_schema in _plugin_properties(
                    fields_cls, components, name, cls, _SET_BY).items():
                field_schema.pop("default", None)
                for target in targets:
                    components[target.__name__]["properties"][field_name] = field_schema
    return components


def _responses(bodies: RouteBodies, op: Operation, has_api_key: bool, path: str
               ) -> dict[str, OpenAPIResponse | Reference]:
    responses: dict[str, OpenAPIResponse | Reference] = {
        code: r for code, r in (op.responses or {}).items() if not code.startswith("4")
        and not code.startswith("5")}
    if bodies.response is not None:
        content = _content(_ref(bodies.response))
        if bodies.stream_chunk is not None:
            content["text/event-stream"] = OpenAPIMediaType(
                schema=_event_stream(bodies.stream_chunk))  # type: ignore[arg-type]
        responses["200"] = OpenAPIResponse(description="The result.", content=content)
    if path in _OK_RESPONSES:
        responses["200"] = _OK_RESPONSES[path]
    errors = set(bodies.errors) | ({401} if has_api_key and path != "/health" else set())
    for status in sorted(errors):
        responses[str(status)] = OpenAPIResponse(
            description=ERROR_DESCRIPTIONS[status], content=_content(_ref(p.ErrorResponse)))
    return responses


def _event_stream(chunk: type[msgspec.Struct]) -> dict[str, Any]:
    """The schema of one event of the ``text/event-stream`` answer (the 3.1 convention for
    event streams, which schemathesis checks each event against; OpenAPI 3.2 names it
    ``itemSchema``): a ``data:`` line holding a ``chunk`` as JSON, an error
    (``ErrorResponse``) after the stream began, or the final ``[DONE]``."""
    data = {"anyOf": [
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": _ref(chunk).to_schema(),
         "description": f"One {chunk.__name__}: every choice's new text (the first event of a "
                        "choice carries its role; with stream_options.include_usage the last "
                        "event before [DONE] has no choices and the usage)."},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": _ref(p.ErrorResponse).to_schema(),
         "description": "An error after the stream began; [DONE] follows."},
        {"const": "[DONE]", "description": "The end of the stream."}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data},
            "description": f"With stream: true, server-sent events, each a `data: <JSON>` line "
                           f"and a blank line: {chunk.__name__} events, an ErrorResponse if the "
                           "request fails after the stream began, then `data: [DONE]`. The "
                           "schema is that of one event."}


def complete_document(openapi: OpenAPI, model_name: str, plugins: dict[str, type[Plugin]],
                      has_api_key: bool, limits: RequestLimits | None = None) -> None:
    """Complete Litestar's document in place (see the module docstring); ``plugins`` are
    the enabled plugin classes by name. Raises ``ValueError`` when
    a served route is missing from ``ROUTES`` or a ``ROUTES`` entry is not served."""
    served: set[tuple[str, str]] = set()
    for path, item in (openapi.paths or {}).items():
        for method in ("get", "post", "put", "delete", "patch"):
            op: Operation | None = getattr(item, method)
            if op is None:
                continue
            served.add((method, path))
            bodies = ROUTES.get((method, path))
            if bodies is None:
                raise ValueError(f"{method.upper()} {path} has no entry in openapi.ROUTES")
            if bodies.request is not None:
                op.request_body = RequestBody(content=_content(_ref(bodies.request)),
                                              required=True)
            op.responses = _responses(bodies, op, has_api_key, path)
            if has_api_key and path != "/health":
                op.security = [{SECURITY_SCHEME: []}]
    missing = set(ROUTES) - served
    if missing:
        raise ValueError(f"openapi.ROUTES names routes the app does not serve: {missing}")
    assert openapi.components is not None  # Litestar always sets it
    schemas = dict(openapi.components.schemas or {})
    schemas.update(_request_schemas(model_name, plugins, limits or RequestLimits()))
    openapi.components.schemas = dict(sorted(schemas.items()))
    if has_api_key:
        openapi.components.security_schemes = {
            SECURITY_SCHEME: SecurityScheme(type="http", scheme="bearer",
                                            description="The server's --api-key.")}
