"""docs/openai_api.md keeps up with the server: every route the app serves and every request
field a plugin owns appears in it (the field on a row of the plugin-fields table that also
names its plugin)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from freetoken_core.config import EngineConfig
from freetoken_core.plugins import PluginManager
from freetoken_core.server.app import ServerConfig, create_app

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai_api.md"
_PARAM_TYPE = re.compile(r"\{(\w+):[^}]+\}")


def served_paths() -> list[str]:
    """The app's route paths (``{model_id:path}`` written ``{model_id}``), built without
    starting the engine (the engine process is spawned only on start-up)."""
    app = create_app(ServerConfig(EngineConfig()))
    return sorted({_PARAM_TYPE.sub(r"{\1}", route.path) for route in app.routes})


def plugin_fields() -> list[tuple[str, str]]:
    return [(info.name, f) for info in PluginManager().describe() for f in info.fields]


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_path_normalisation() -> None:
    assert _PARAM_TYPE.sub(r"{\1}", "/v1/models/{model_id:path}") == "/v1/models/{model_id}"


def test_the_app_serves_the_openai_routes() -> None:
    paths = served_paths()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        assert path in paths


def test_every_served_route_is_documented(doc: str) -> None:
    missing = [path for path in served_paths() if f"`{path}`" not in doc
               and not re.search(rf"`(GET|POST) {re.escape(path)}`", doc)]
    assert not missing, f"routes served but not in {DOC.name}: {missing}"


def test_the_plugins_own_fields() -> None:
    assert {"logit_bias", "min_p", "presence_penalty"} <= {f for _, f in plugin_fields()}


def test_every_plugin_field_is_documented_with_its_plugin(doc: str) -> None:
    rows = [line for line in doc.splitlines() if line.startswith("|")]
    missing = [(plugin, f) for plugin, f in plugin_fields()
               if not any(f"`{f}`" in row and f"`{plugin}`" in row for row in rows)]
    assert not missing, f"plugin fields without a row naming their plugin: {missing}"
