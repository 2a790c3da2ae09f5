"""The tool-calls plugin's tests (test_plugin_tool_calls.py) again, against a
tensor-parallel server (``--tensor-parallel-size 2``): forced calls' grammars mask rank
0's gathered logits, and the parsers read the same text as on one rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import Server, start_server, stop_server
from test_plugin_tool_calls import *  # its tests and fixtures, collected here


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, "--tensor-parallel-size", "2",
                       log_file=tmp_path_factory.mktemp("tp2-tools") / "serve.log")
    yield srv
    stop_server(srv)
