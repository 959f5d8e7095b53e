"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
from serve_process import (
    COMPILED_STARTUP_TIMEOUT,
    ENGINE_ARGS,
    PROGRAMS_READY,
    ServeProcess,
    start_serve,
)


@pytest.fixture(scope="session")
def folio_server(default_model_dir, tmp_path_factory) -> ServeProcess:
    """One real `folio serve` with the default model, shared by every test that talks to it.
    Its decode steps run compiled (the suite's other engines run eagerly: FOLIO_ENFORCE_EAGER),
    from the first test on: the fixture waits for its programs (loaded, or built in the
    background while it served eagerly), so that no test's requests straddle the switch, across
    which the default GGUF's greedy tokens may differ at a near-tie (test_serve's
    test_decode_steps_run_compiled)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = start_serve(log, *ENGINE_ARGS, "--no-enforce-eager", timeout=COMPILED_STARTUP_TIMEOUT)
    server.wait_for_output(PROGRAMS_READY, COMPILED_STARTUP_TIMEOUT)
    yield server
    server.stop()
