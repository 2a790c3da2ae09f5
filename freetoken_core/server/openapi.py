"""The served OpenAPI document (``GET /schema/openapi.json``) and its Swagger UI
(``/schema``, ``/schema/swagger``).

Litestar derives the document from the routes, but the generation, tokenize and
detokenize routes read their raw body (``parse_body`` names the bad field in the 400 and
keeps undeclared fields as plugin fields), so Litestar sees no body type there.
``complete_document`` adds what it cannot see, once, when the app is built:

- each body route's request body and its 200 body: msgspec's JSON Schema of the
  ``protocol`` Structs, the constraints the server checks included; the generation
  routes answer ``text/event-stream`` as well when ``stream`` is true;
- the request fields the enabled plugins own, with the JSON Schema of their types (each
  plugin's ``Fields``), on the routes the plugin serves, each described with its plugin,
  and the chat message keys they own (``ChatMessageFields``),
  and the accepted-without-effect ``IGNORED_FIELDS``; any other field is a 400, so the generation
  requests are closed (``additionalProperties: false``);
- ``model`` as the one name served (another is a 404);
- the OpenAI error answers (``ErrorResponse``) of every route, and under ``--api-key`` the
  bearer scheme and the 401 on every route but ``/health``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
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

_PLUGIN_FIELD_REQUESTS = {p.CompletionRequest: "completions", p.ChatCompletionRequest: "chat"}
_MODEL_REQUESTS = (p.CompletionRequest, p.ChatCompletionRequest, p.TokenizeRequest,
                   p.DetokenizeRequest)


def openapi_config(version: str) -> OpenAPIConfig:
    """The JSON document at ``/schema/openapi.json`` and Swagger UI at ``/schema`` and
    ``/schema/swagger``; no other documentation site."""
    return OpenAPIConfig(
        title="FreeToken", version=version, path=SCHEMA_PATH,
        description="An OpenAI-compatible inference server (see docs/openai_api.md).",
        render_plugins=[SwaggerRenderPlugin(), JsonRenderPlugin()])


def _content(schema: dict[str, Any] | Reference) -> dict[str, OpenAPIMediaType]:
    return {"application/json": OpenAPIMediaType(schema=schema)}  # type: ignore[arg-type]


def _ref(cls: type) -> Reference:
    return Reference(ref=_REF.format(name=cls.__name__))


def _plugin_properties(fields_cls: type[msgspec.Struct], components: dict[str, Any]
                       ) -> dict[str, Any]:
    """The JSON Schema of each field of a plugin's ``fields_cls`` (``Fields``,
    ``MessageFields``, ``UsageFields``); the structs its types use are added to
    ``components``."""
    (ref,), found = msgspec.json.schema_components([fields_cls], ref_template=_REF)
    own = found.pop(ref["$ref"].rsplit("/", 1)[-1])
    components.update(found)
    return own.get("properties", {})


def _request_schemas(model_name: str, plugins: dict[str, type[Plugin]]) -> dict[str, Any]:
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
    owned = {name: (cls, _plugin_properties(cls.Fields, components))
             for name, cls in sorted(plugins.items()) if cls.Fields is not None}
    for request_cls, route in _PLUGIN_FIELD_REQUESTS.items():
        schema = components[request_cls.__name__]
        properties = schema["properties"]
        for name in sorted(p.IGNORED_FIELDS):
            properties.setdefault(name, {"description": "Accepted, without effect."})
        for plugin, (cls, fields) in owned.items():
            if route not in cls.routes:
                continue
            for field_name, field_schema in fields.items():
                note = f"Owned by the plugin `{plugin}` (see docs/openai_api.md)."
                text = field_schema.get("description")
                properties[field_name] = {**field_schema,
                                          "description": f"{text} {note}" if text else note}
        # Any other field is a 400 naming it (PluginManager.require_field).
        schema["additionalProperties"] = False
    message = components[p.ChatMessage.__name__]
    for name, cls in sorted(plugins.items()):
        if cls.ChatMessageFields is None:
            continue
        note = f"Owned by the plugin `{name}` (see docs/openai_api.md)."
        for field_name, field_schema in _plugin_properties(cls.ChatMessageFields,
                                                           components).items():
            text = field_schema.get("description")
            message["properties"][field_name] = {
                **field_schema, "description": f"{text} {note}" if text else note}
    message["additionalProperties"] = False  # another key is a 400 naming it
    for name, cls in sorted(plugins.items()):
        for attr, targets in (("MessageFields", (p.ResponseMessage, p.DeltaMessage)),
                              ("UsageFields", (p.Usage,))):
            fields_cls = getattr(cls, attr)
            if fields_cls is None:
                continue
            note = f"Set by the plugin `{name}`; absent otherwise."
            for field_name, field_schema in _plugin_properties(fields_cls, components).items():
                field_schema.pop("default", None)
                text = field_schema.get("description")
                for target in targets:
                    components[target.__name__]["properties"][field_name] = {
                        **field_schema, "description": f"{text} {note}" if text else note}
    return components


def _responses(bodies: RouteBodies, op: Operation, has_api_key: bool, path: str
               ) -> dict[str, OpenAPIResponse | Reference]:
    responses: dict[str, OpenAPIResponse | Reference] = {
        code: r for code, r in (op.responses or {}).items() if not code.startswith("4")
        and not code.startswith("5")}
    if bodies.response is not None:
        content = _content(_ref(bodies.response))
        if bodies.stream_chunk is not None:
            content["text/event-stream"] = OpenAPIMediaType(schema={  # type: ignore[arg-type]
                "type": "string",
                "description": f"With stream: true, one `data: <{bodies.stream_chunk.__name__}"
                               "JSON>` event per step, then `data: [DONE]`."})
        responses["200"] = OpenAPIResponse(description="The result.", content=content)
    if path in _OK_RESPONSES:
        responses["200"] = _OK_RESPONSES[path]
    errors = set(bodies.errors) | ({401} if has_api_key and path != "/health" else set())
    for status in sorted(errors):
        responses[str(status)] = OpenAPIResponse(
            description=ERROR_DESCRIPTIONS[status], content=_content(_ref(p.ErrorResponse)))
    return responses


def complete_document(openapi: OpenAPI, model_name: str, plugins: dict[str, type[Plugin]],
                      has_api_key: bool) -> None:
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
    schemas.update(_request_schemas(model_name, plugins))
    openapi.components.schemas = dict(sorted(schemas.items()))
    if has_api_key:
        openapi.components.security_schemes = {
            SECURITY_SCHEME: SecurityScheme(type="http", scheme="bearer",
                                            description="The server's --api-key.")}
