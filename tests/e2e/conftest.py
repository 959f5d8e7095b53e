"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
from serve_process import ENGINE_ARGS, ServeProcess, start_serve


@pytest.fixture(scope="session")
def folio_server(default_model_dir, tmp_path_factory) -> ServeProcess:
    """One real `folio serve` with the default model, shared by every test that talks to it."""
    server = start_serve(tmp_path_factory.mktemp("serve") / "serve.log", *ENGINE_ARGS)
    yield server
    server.stop()
