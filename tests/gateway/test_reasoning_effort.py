"""reasoning_effort (chat) and reasoning.effort (Responses) reach the chat template as its
variable reasoning_effort: a tokenizer service with gpt-oss's template (which writes it into the
system message) beside the default model's engine, a real gateway in front; the prompt the
gateway plans is checked, then a request of each API runs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from common.config import TokenizerOptions
from gateway.openai import completions
from gateway.openai import protocol as api
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses.translate import chat_request
from gateway_helpers import GatewayThread
from grpc_helpers import TIMEOUT, ServerThread
from services.tokenizer.server import TokenizerService

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "gpt_oss.jinja"
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def gateway(services, default_model_dir):
    engine, _ = services
    tokenizer = ServerThread(
        TokenizerService(
            str(default_model_dir), "127.0.0.1", 0, TokenizerOptions(chat_template=str(TEMPLATE))
        )
    )
    server = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
    yield server
    server.close()
    tokenizer.close()


def planned_prompt(gateway: GatewayThread, body: api.ChatCompletionRequest) -> str:
    _, _, prompt = gateway.call(completions.chat_prompt(gateway.server.gateway, body))
    return prompt.prompt


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({}, "medium"),  # the template's own default
        ({"reasoning_effort": "high"}, "high"),
        ({"reasoning_effort": "low"}, "low"),
        # What chat_template_kwargs sets wins.
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high"),
    ],
)
def test_reasoning_effort_reaches_the_template(gateway, fields, said):
    body = api.ChatCompletionRequest.model_validate({"messages": ASK, **fields})
    assert f"Reasoning: {said}\n" in planned_prompt(gateway, body)


def test_the_responses_reasoning_effort_is_chats(gateway):
    body = rapi.ResponsesRequest.model_validate(
        {"input": "Name a colour.", "reasoning": {"effort": "high", "summary": "auto"}}
    )
    assert "Reasoning: high\n" in planned_prompt(gateway, chat_request(body))
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as http:
        answered = http.post(
            "/v1/responses",
            json={"input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "low"}},
        )
        assert answered.status_code == 200, answered.text
        assert answered.json()["reasoning"] == {"effort": "low", "summary": None}
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 2, "reasoning_effort": "high"},
        )
        assert chat.status_code == 200, chat.text
        for path, body in (
            ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "extreme"}),
            ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "extreme"}}),
            ("/v1/responses", {"input": "Hi", "reasoning": {"summary": "detailed"}}),
        ):
            refused = http.post(path, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] in ("reasoning_effort", "reasoning")
