"""One ``freetoken serve`` of the embedded default model for every agent-framework module
(issue 31 item 4), and a guard that lets those tests open no connection but loopback.

The frameworks' own network habits are switched off before any of them is imported (this
conftest is imported before the modules of its directory): litellm reads its bundled model
cost map instead of fetching it, LangSmith tracing stays off; openai-agents' trace export
is switched off in its module (``set_tracing_disabled``). The socket guard then makes any
other attempt fail the test instead of reaching out."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

from server_fixtures import Server, start_server, stop_server

MODEL_NAME = "default"
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _is_loopback(address: object) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX
        return True
    return isinstance(address, tuple) and str(address[0]) in LOOPBACK


@pytest.fixture(scope="module", autouse=True)
def loopback_only() -> Iterator[None]:
    """Every connection a framework test opens goes to loopback; any other fails loudly.
    Module-scoped: a session-scoped one would stay on for the modules of other folders."""
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded(method):
        def wrapper(sock: socket.socket, address: object):
            if not _is_loopback(address):
                raise AssertionError(f"a framework test tried to reach {address!r}")
            return method(sock, address)
        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", guarded(connect))
        mp.setattr(socket.socket, "connect_ex", guarded(connect_ex))
        yield


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``freetoken serve`` without ``--model`` (the embedded default model), served as
    ``default``, shared by every framework module (a start costs ~15-30 s)."""
    srv = start_server(None, "--served-model-name", MODEL_NAME,
                       log_file=tmp_path_factory.mktemp("framework-server") / "serve.log")
    srv.model = MODEL_NAME
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def base_url(default_server: Server) -> str:
    """The server's OpenAI base URL (``.../v1``), as every framework takes it."""
    return f"{default_server.url}/v1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The framework modules load the real default model: mark them ``slow`` as its other
    users are."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[Any]:
    """The official ``openai`` client on the shared server (no retries: a failure shows at
    once)."""
    import openai

    with openai.OpenAI(base_url=base_url, api_key="sk-dummy", max_retries=0) as c:
        yield c
