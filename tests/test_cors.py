"""CORS: off by default; ``--allowed-origins`` and friends (vLLM's flags) turn it on, and a
preflight is answered even under ``--api-key``. The app is driven with Litestar's test
client (no engine); one real ``freetoken serve`` checks the flags end to end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient
from server_fixtures import Server, start_server, stop_server

from freetoken_core.cli import _cors_settings, build_parser
from freetoken_core.config import EngineConfig
from freetoken_core.server.app import ServerConfig, create_app
from freetoken_core.server.cors import CorsSettings, CorsSettingsError, parse_list

APP = "https://app.example"
KEY = "sesame"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def client(cors: CorsSettings | None, api_key: str | None = KEY) -> TestClient:
    return TestClient(create_app(ServerConfig(EngineConfig(), api_key=api_key, cors=cors)))


def cors_headers(headers: object) -> dict[str, str]:
    return {k.lower(): v for k, v in dict(headers).items()  # type: ignore[call-overload]
            if k.lower().startswith("access-control-")}


def test_off_by_default() -> None:
    c = client(None)
    r = c.get("/version", headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and cors_headers(r.headers) == {}
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 401 and cors_headers(r.headers) == {}


def test_an_allowed_origin_gets_the_headers() -> None:
    c = client(CorsSettings((APP,)))
    r = c.get("/version", headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP
    r = c.get("/version", headers={"Origin": "https://evil.example",
                                   "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("api_key", [KEY, None])
def test_preflight_is_answered_without_the_api_key(api_key: str | None) -> None:
    c = client(CorsSettings((APP,), ("GET", "POST"), ("authorization", "content-type")),
               api_key=api_key)
    r = c.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code in (200, 204), r.text
    headers = cors_headers(r.headers)
    assert headers["access-control-allow-origin"] == APP
    assert set(headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert {"authorization", "content-type"} <= {
        h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}


def test_only_a_preflight_skips_the_api_key() -> None:
    c = client(CorsSettings((APP,)))
    assert c.options("/v1/chat/completions").status_code == 401  # no Origin: not a preflight
    r = c.post("/v1/chat/completions", headers={"Origin": APP}, json={})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == APP  # so the browser shows the 401


def test_credentials_header() -> None:
    c = client(CorsSettings((APP,), allow_credentials=True))
    r = c.options("/v1/completions", headers=PREFLIGHT)
    assert r.headers["access-control-allow-credentials"] == "true"


@pytest.mark.parametrize(("text", "expected"), [
    ('["https://a.example", "http://localhost:3000"]',
     ("https://a.example", "http://localhost:3000")),
    ("https://a.example, http://localhost:3000", ("https://a.example", "http://localhost:3000")),
    ("*", ("*",)),
    ('["*"]', ("*",)),
])
def test_lists_are_json_or_comma_separated(text: str, expected: tuple[str, ...]) -> None:
    assert parse_list(text) == expected


@pytest.mark.parametrize("text", ["[1, 2]", '["a",', '{"a": 1}'])
def test_bad_lists_are_refused(text: str) -> None:
    with pytest.raises(CorsSettingsError):
        parse_list(text)


def test_settings_are_validated() -> None:
    with pytest.raises(CorsSettingsError, match="at least one origin"):
        CorsSettings(())
    with pytest.raises(CorsSettingsError, match="unknown method"):
        CorsSettings((APP,), ("FETCH",))
    with pytest.raises(CorsSettingsError, match="explicit --allowed-origins"):
        CorsSettings(("*",), allow_credentials=True)


def serve_args(*flags: str) -> object:
    return build_parser().parse_args(["serve", *flags])


def test_the_flags() -> None:
    assert _cors_settings(serve_args()) is None
    settings = _cors_settings(serve_args(
        "--allowed-origins", '["http://localhost:3000"]', "--allowed-methods", "GET,POST",
        "--allowed-headers", '["Authorization"]', "--allow-credentials"))
    assert settings == CorsSettings(("http://localhost:3000",), ("GET", "POST"),
                                    ("Authorization",), True)
    assert _cors_settings(serve_args("--allowed-origins", "*")) == CorsSettings(("*",))
    with pytest.raises(CorsSettingsError, match="needs --allowed-origins"):
        _cors_settings(serve_args("--allowed-methods", "GET"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--api-key", KEY, "--allowed-origins",
                       f'["{APP}"]', "--allowed-methods", '["GET", "POST"]', api_key=KEY)
    yield srv
    stop_server(srv)


def test_served_with_the_flags(server: Server) -> None:
    r = server.http.options("/v1/completions", headers=PREFLIGHT)
    assert r.status_code in (200, 204), r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    r = server.http.post("/v1/completions", headers={
        "Origin": APP, "Authorization": f"Bearer {KEY}"},
        json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP
    r = server.http.get("/version", headers={"Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers  # no Origin: no CORS headers
