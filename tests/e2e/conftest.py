"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
from serve_process import COMPILED_STARTUP_TIMEOUT, ENGINE_ARGS, ServeProcess, start_serve


@pytest.fixture(scope="session")
def folio_server(default_model_dir, tmp_path_factory) -> ServeProcess:
    """One real `folio serve` with the default model, shared by every test that talks to it.
    Its decode steps run compiled (the suite's other engines run eagerly: FOLIO_ENFORCE_EAGER)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = start_serve(log, *ENGINE_ARGS, "--no-enforce-eager", timeout=COMPILED_STARTUP_TIMEOUT)
    yield server
    server.stop()
