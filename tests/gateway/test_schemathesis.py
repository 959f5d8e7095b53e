"""schemathesis against the live gateway's own /openapi.json: generated requests, valid and
invalid, to every operation get no 5xx, only documented status codes and content types, and
bodies that match the published schemas.

Generation is kept short (a fuzzer must not run long generations on a loaded CPU): every body
asks for a token or two of one or two choices. The default suite runs schemathesis' examples
and fuzzing phases, valid and invalid data, 25 examples per operation; FOLIO_FUZZ_EXAMPLES
raises that number and adds the coverage phase (every boundary value of every field: some
thousand requests, minutes)."""

from __future__ import annotations

import os

import pytest
import schemathesis

# Imported now, at collection, not lazily by from_url in the test: pytest rewrites a plugin's
# modules as they load (ast.parse). On CPython 3.11.7 an ast.parse fails with "AST constructor
# recursion depth mismatch" when the garbage collector, inside it, finalizes a coroutine whose
# finalizer formats a traceback (another ast.parse, sharing the module's state): a Generate
# stream's sender left suspended on a closed loop was one (test_availability.py tests that no
# broken stream leaves one).
import schemathesis.specs.openapi.schemas
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

LONG_RUN = "FOLIO_FUZZ_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("FOLIO_FUZZ_EXAMPLES", "25"))
# Bounds on what one generated request may cost; values below them are kept as generated.
MAX_TOKENS = 2
MAX_CHOICES = 2
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api_schema(gateway):
    config = SchemathesisConfig.from_dict(
        {
            "phases": {"coverage": {"enabled": LONG_RUN}, "stateful": {"enabled": False}},
            "generation": {"max-examples": EXAMPLES, "mode": "all"},
        }
    )
    # The dashboard's feed never ends (a fuzzer would wait on it forever); test_webui.py
    # tests it.
    return schemathesis.openapi.from_url(gateway.url + "/openapi.json", config=config).exclude(
        path="/dashboard/feed"
    )


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request):
    # schemathesis 4.32.5 names its subtests through the private Function._nodeid of pytest < 9.
    request.node._nodeid = request.node.nodeid


def cheap(path: str, body: object, model: str) -> None:
    """Bound a generated body's work in place: few tokens, few choices, few inputs, the served
    model."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model  # any other name is a plain 404 (test_errors.py)
    for field in ("input", "text_1", "text_2", "documents"):  # embeddings, scores, reranking
        inputs = body.get(field)
        if path.endswith(("embeddings", "score", "rerank")) and isinstance(inputs, list):
            del inputs[MAX_CHOICES:]  # each input is a request of its own
    if not path.endswith(("completions", "responses")):
        return
    limit = "max_output_tokens" if path.endswith("responses") else "max_tokens"
    for field in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        value = body.get(field)
        if type(value) is int and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if body.get(limit) is None:
        body[limit] = MAX_TOKENS  # unset or null fills the context
    if type(body.get("n")) is int and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        del prompt[MAX_CHOICES:]  # a batch of prompts is a request per prompt


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_gateway_keeps_to_its_openapi_document(case, gateway):
    cheap(case.path, case.body, "SmolLM2-135M-Instruct")
    case.call_and_validate(checks=CHECKS, timeout=60)
