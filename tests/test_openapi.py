"""The served OpenAPI document describes every route's bodies, the plugin fields and the
errors, and states the rules the server checks beyond the types (``openapi_rules``); it is
a valid OpenAPI 3.1 document (openapi-spec-validator); the schema pages are served (JSON
and Swagger UI only) and, under ``--api-key``, need the key. Built with Litestar's test
client and no engine (start-up never runs)."""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from freetoken_core.config import EngineConfig
from freetoken_core.plugins import PluginManager
from freetoken_core.processors import ModelInfo
from freetoken_core.server import protocol as p
from freetoken_core.server.app import ServerConfig, create_app
from freetoken_core.server.openapi import ROUTES
from freetoken_core.server.openapi_rules import CHECKS, add_model_rules

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
GENERATION = {"/v1/completions": "CompletionRequest",
              "/v1/chat/completions": "ChatCompletionRequest"}


def client(api_key: str | None = None, plugins: str | None = None) -> TestClient:
    config = ServerConfig(EngineConfig(plugins=plugins), "served/name", api_key=api_key)
    return TestClient(create_app(config))


def document(**kwargs: Any) -> dict[str, Any]:
    r = client(**kwargs).get("/schema/openapi.json", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return document()


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method, path): op for path, item in doc["paths"].items()
            for method, op in item.items()}


def ref(media: dict[str, Any]) -> str:
    return media["schema"]["$ref"].removeprefix("#/components/schemas/")


def test_every_served_route_is_in_the_document(doc: dict[str, Any]) -> None:
    assert set(operations(doc)) == set(ROUTES)
    assert doc["info"]["title"] == "FreeToken"


@pytest.mark.parametrize(("path", "request_name", "response_name"), [
    ("/v1/completions", "CompletionRequest", "CompletionResponse"),
    ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ("/tokenize", "TokenizeRequest", "TokenizeResponse"),
    ("/v1/tokenize", "TokenizeRequest", "TokenizeResponse"),
    ("/detokenize", "DetokenizeRequest", "DetokenizeResponse"),
    ("/v1/detokenize", "DetokenizeRequest", "DetokenizeResponse"),
])
def test_body_routes_show_their_request_and_response(
        doc: dict[str, Any], path: str, request_name: str, response_name: str) -> None:
    op = doc["paths"][path]["post"]
    assert op["requestBody"]["required"] is True
    assert ref(op["requestBody"]["content"]["application/json"]) == request_name
    assert ref(op["responses"]["200"]["content"]["application/json"]) == response_name
    for status in ("400", "404", "503"):
        assert ref(op["responses"][status]["content"]["application/json"]) == "ErrorResponse"
    schemas = doc["components"]["schemas"]
    assert request_name in schemas and response_name in schemas


def test_generation_routes_also_answer_an_event_stream(doc: dict[str, Any]) -> None:
    for path in GENERATION:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    assert "ChatCompletionChunk" in doc["components"]["schemas"]


def test_request_schemas_carry_the_type_constraints(doc: dict[str, Any]) -> None:
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    temperature = next(s for s in props["temperature"]["anyOf"] if s.get("type") == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert props["n"]["maximum"] == p.MAX_N
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["required"] == ["messages"]
    assert props["model"]["enum"] == ["served/name", None]


def test_plugin_fields_are_properties_naming_their_plugin(doc: dict[str, Any]) -> None:
    manager = PluginManager()
    owners = manager.field_owners()
    classes = manager.plugin_classes()
    assert {"min_p", "logit_bias", "presence_penalty", "suffix", "response_format"} <= set(owners)
    for name in GENERATION.values():
        route = "chat" if name.startswith("Chat") else "completions"
        schema = doc["components"]["schemas"][name]
        for field, plugin in owners.items():
            if route not in classes[plugin].routes:  # suffix: completions only
                assert field not in schema["properties"], (name, field)
                continue
            prop = schema["properties"][field]
            assert f"`{plugin}`" in prop["description"], (name, field)
            assert prop[CHECKS] == [f"validated by the plugin `{plugin}`"]
            assert "docs/openai_api.md" not in prop["description"]
            for rule in classes[plugin].request_rules:
                assert rule in schema["allOf"], (name, plugin)
        for field in p.IGNORED_FIELDS:
            assert field in schema["properties"]
        # Any other field is a 400 naming it, so the schema is closed.
        assert schema["additionalProperties"] is False


def test_plugin_response_fields_are_published(doc: dict[str, Any]) -> None:
    """The reasoning plugin declares them; the server does not name them."""
    schemas = doc["components"]["schemas"]
    for name in ("ResponseMessage", "DeltaMessage"):
        assert "`reasoning`" in schemas[name]["properties"]["reasoning_content"]["description"]
    details = schemas["Usage"]["properties"]["completion_tokens_details"]
    assert details["$ref"].endswith("/CompletionTokensDetails")
    assert "reasoning_tokens" in schemas["CompletionTokensDetails"]["properties"]


def test_without_plugins_no_plugin_field_is_offered() -> None:
    schema = document(plugins="none")["components"]["schemas"]["CompletionRequest"]
    assert "min_p" not in schema["properties"]
    assert "logit_bias" not in schema["properties"]


def test_no_security_scheme_without_an_api_key(doc: dict[str, Any]) -> None:
    assert "securitySchemes" not in doc["components"]
    assert all("401" not in op["responses"] for op in operations(doc).values())


def test_with_an_api_key_every_route_but_health_declares_it() -> None:
    doc = document(api_key=KEY)
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for (method, path), op in operations(doc).items():
        if path == "/health":
            assert "security" not in op and "401" not in op["responses"]
        else:
            assert op["security"] == [{"bearer": []}], path
            assert ref(op["responses"]["401"]["content"]["application/json"]) == "ErrorResponse"


def test_the_schema_pages_served() -> None:
    c = client()
    assert c.get("/schema/openapi.json").status_code == 200
    for page in ("/schema", "/schema/swagger"):
        r = c.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "swagger-ui" in r.text
    for page in ("/schema/redoc", "/schema/elements", "/schema/rapidoc", "/schema/openapi.yaml"):
        assert c.get(page).status_code == 404, page


@pytest.mark.parametrize("page", ["/schema", "/schema/swagger", "/schema/openapi.json",
                                  "/schema/redoc"])
def test_schema_pages_need_the_api_key(page: str) -> None:
    c = client(api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = c.get(page, headers=headers)
        # JSON even before an HTML page (this was a 500: the error body was
        # serialized as HTML).
        assert r.status_code == 401, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = c.get(page, headers=AUTH)
    assert r.status_code == (404 if page == "/schema/redoc" else 200)


def test_the_document_is_valid_openapi(doc: dict[str, Any]) -> None:
    from openapi_spec_validator import validate

    validate(doc)
    validate(document(api_key=KEY))
    validate(document(plugins="none"))


def test_a_plugin_field_carries_the_plugin_s_own_text(doc: dict[str, Any]) -> None:
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    # The docstring under the attribute in the plugin's Fields.
    assert props["parallel_tool_calls"]["description"].startswith(
        "false: at most one call (guaranteed under required).")
    assert "disable_additional_properties" in props["structured_outputs"]["description"]


def validator(doc: dict[str, Any], name: str) -> Any:
    """A JSON Schema validator of component ``name``, its references resolved."""
    import jsonschema

    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(("name", "body", "valid"), [
    ("CompletionRequest", {"prompt": "x", "top_k": 0}, False),
    ("CompletionRequest", {"prompt": "x", "top_k": -1}, True),
    ("CompletionRequest", {"prompt": "x", "top_k": -2}, False),
    ("CompletionRequest", {"prompt": ""}, False),
    ("CompletionRequest", {"prompt": []}, False),
    ("CompletionRequest", {"prompt": [[]]}, False),
    ("CompletionRequest", {"prompt": [[1, 2], [3]]}, True),
    ("CompletionRequest", {"prompt": "x", "stream_options": {"include_usage": True}}, False),
    ("CompletionRequest", {"prompt": "x", "stream": True,
                           "stream_options": {"include_usage": True}}, True),
    ("CompletionRequest", {"prompt": "x", "top_logprobs": 2}, False),
    ("CompletionRequest", {"prompt": "x", "best_of": 2}, False),
    ("CompletionRequest", {"prompt": "x", "stop": [""] * 65}, False),
    ("CompletionRequest", {"prompt": "x", "cache_salt": ""}, False),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "json_object"},
                           "structured_outputs": {"regex": "a"}}, False),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "text"},
                           "structured_outputs": {"regex": "a"}}, True),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "json_schema"}}, False),
    ("CompletionRequest", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {}}}}, False),
    ("CompletionRequest", {"prompt": "x", "response_format": {  # not read under text
        "type": "text", "json_schema": {"schema": {}}}}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "top_logprobs": 2}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "top_logprobs": 2, "logprobs": True}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "tool_choice": "required"}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "tool_choice": "none"}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     False),
    ("ChatCompletionRequest", {"messages": [{"role": "assistant", "content": "x"}],
                               "continue_final_message": True}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "assistant", "content": "x"}],
                               "continue_final_message": True, "add_generation_prompt": False},
     True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "x"}],
                               "chat_template_kwargs": {"tokenize": True}}, False),
    ("TokenizeRequest", {}, False),
    ("TokenizeRequest", {"prompt": "x", "messages": []}, False),
    ("TokenizeRequest", {"prompt": "x"}, True),
    ("DetokenizeRequest", {"tokens": [-1]}, False),
])
def test_the_server_s_rules_are_in_the_schemas(doc: dict[str, Any], name: str,
                                               body: dict[str, Any], valid: bool) -> None:
    assert validator(doc, name).is_valid(body) is valid


def test_the_model_s_bounds_appear_once_it_has_loaded() -> None:
    app = create_app(ServerConfig(EngineConfig(), "served/name"))
    c = TestClient(app)
    before = c.get("/schema/openapi.json").json()
    assert "maximum" not in before["components"]["schemas"]["DetokenizeRequest"][
        "properties"]["tokens"]["items"]
    add_model_rules(app.openapi_schema.components.schemas, ModelInfo(100, frozenset({2}), 64))
    after = c.get("/schema/openapi.json").json()  # rendered afresh
    assert validator(after, "DetokenizeRequest").is_valid({"tokens": [99]})
    assert not validator(after, "DetokenizeRequest").is_valid({"tokens": [100]})
    completion = validator(after, "CompletionRequest")
    assert not completion.is_valid({"prompt": [[100]]})
    assert not completion.is_valid({"prompt": "x", "top_k": 101})
    assert not completion.is_valid({"prompt": "x", "max_tokens": 64})
    assert completion.is_valid({"prompt": [5], "top_k": 100, "max_tokens": 63})


def test_event_streams_are_described_per_event(doc: dict[str, Any]) -> None:
    for path, chunk in (("/v1/chat/completions", "ChatCompletionChunk"),
                        ("/v1/completions", "CompletionResponse")):
        stream = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
        events = stream["schema"]["properties"]["data"]["anyOf"]
        assert [e.get("contentSchema", {}).get("$ref", e.get("const")) for e in events] == [
            f"#/components/schemas/{chunk}", "#/components/schemas/ErrorResponse", "[DONE]"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_schemathesis_generates_data_for_the_bodies(doc: dict[str, Any], path: str) -> None:
    """More than about five conditionals in one schema and schemathesis gives up."""
    import hypothesis
    import schemathesis

    operation = schemathesis.openapi.from_dict(doc)[path]["POST"]
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        @hypothesis.settings(max_examples=5, database=None, deadline=None,
                             phases=[hypothesis.Phase.generate],
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def draw(case: Any) -> None:
            assert case.body is not None

        draw()
