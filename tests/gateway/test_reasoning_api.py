"""Reasoning output end to end: real tokenizer and engine services on a tiny random model whose
SmolLM2 vocabulary has `<think>` and `</think>` (and harmony's markers) as single tokens and a
Qwen-style chat template with <think> (so the tokenizer reports the qwen3 format), three real
gateways in front of them (the template's format, deepseek_r1, gpt_oss with harmony's `openai`
tool calls), the real `openai` client.

A random model never thinks by itself: logit_bias ranks a few tokens far above the rest and a
repetition penalty of 10 pushes each one below the next once written, so greedy decoding writes
exactly `<think> Hmm</think> Yes` (qwen3) or `<|channel|> analysis<|message|> Hmm<|end|> Yes`
(harmony), through the real engine, detokenizer and parser, whole and streamed. Under a
harmony grammar the biased tokens write the analysis and pick the next channel; the grammar
writes the rest (the final answer, or the call)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from common.config import EngineConfig
from common.tokenizer import Tokenizer
from gateway.openai.reasoning.plan import ReasoningPlan
from gateway.openai.responses import events as response_events
from gateway.openai.responses import protocol as rapi
from gateway.openai.responses.translate import ResponseHead
from gateway.openai.tools.parsers import HarmonyToolParser, parse_whole
from gateway.pipeline.text import TextDelta, Usage
from gateway_helpers import ENGINE_ARGS, gateway_command, start_gateway
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

# SmolLM2's special tokens 3..8 renamed (the vocabulary keeps its size, the tiny model fits).
RENAMED = {
    3: ("<think>", False),
    4: ("</think>", False),
    5: ("<|channel|>", True),
    6: ("<|message|>", True),
    7: ("<|end|>", True),
    8: ("<|start|>", True),
    9: ("<|constrain|>", True),
    10: ("<|return|>", True),
    11: ("<|call|>", True),
}
THINK, END_THINK, CHANNEL, MESSAGE, END, START = 3, 4, 5, 6, 7, 8
HMM, YES, ANALYSIS = 41827, 9230, 2318  # " Hmm", " Yes", " analysis"
# "analysis", "final", "comment": the harmony grammar's channel names have no leading space.
ANALYSIS_CHANNEL, FINAL, COMMENT = 14975, 17254, 3591
TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
MODEL = "tiny-think"  # the model directory's name
MESSAGES = [{"role": "user", "content": "Hi"}]


def ranked(*token_ids: int) -> dict[str, Any]:
    """Sampling that writes `token_ids` in order, greedily, whatever the random weights."""
    bias = {str(t): 100.0 - 10 * i for i, t in enumerate(token_ids)}
    return {"logit_bias": bias, "repetition_penalty": 10.0}


THINKING = ranked(THINK, HMM, END_THINK, YES)  # <think> Hmm</think> Yes
HARMONY = ranked(CHANNEL, ANALYSIS, MESSAGE, HMM, END, YES)


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory, default_model_dir) -> Path:
    directory = make_tiny_smollm2(tmp_path_factory.mktemp(MODEL, numbered=False), default_model_dir)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for added in tokenizer["added_tokens"]:
        if added["id"] in RENAMED:
            del vocab[added["content"]]
            added["content"], added["special"] = RENAMED[added["id"]]
            vocab[added["content"]] = added["id"]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def services(think_model_dir):
    tokenizer = ServerThread(TokenizerService(str(think_model_dir), "127.0.0.1", 0))
    engine = ServerThread(
        EngineService(
            EngineConfig(model=str(think_model_dir), **dict(ENGINE_ARGS, dtype="float32")),
            "127.0.0.1",
            0,
        )
    )
    yield engine, tokenizer
    engine.close()
    tokenizer.close()


def _client(gateway) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=4 * TIMEOUT
    )


@pytest.fixture(scope="module")
def gateways(services):
    """The gateways by parser: the template's format (qwen3), deepseek_r1 and gpt_oss."""
    started = {
        "template": start_gateway(services),
        "deepseek_r1": start_gateway(services, reasoning_parser="deepseek_r1"),
        "gpt_oss": start_gateway(services, reasoning_parser="gpt_oss", tool_call_parser="openai"),
    }
    yield started
    for gateway in started.values():
        gateway.close()


@pytest.fixture(scope="module")
def clients(gateways) -> dict[str, openai.OpenAI]:
    return {name: _client(gateway) for name, gateway in gateways.items()}


def chat(client: openai.OpenAI, sampling: dict[str, Any], **fields: Any):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=fields.pop("max_tokens", 4),
        extra_body={**sampling, **fields.pop("extra_body", {})},
        **fields,
    )


def streamed(client: openai.OpenAI, sampling: dict[str, Any], **fields: Any):
    """The streamed answer's reasoning, content, calls (name, arguments) and finish reason."""
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in chat(client, sampling, stream=True, **fields):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (
                name + (call.function.name or ""),
                arguments + (call.function.arguments or ""),
            )
        reason = choice.finish_reason or reason
    return reasoning, content, list(calls.values()), reason


def test_the_template_format_splits_reasoning_whole_and_streamed(clients):
    client = clients["template"]
    message = chat(client, THINKING).choices[0].message
    assert (message.reasoning_content, message.content) == (" Hmm", "Yes")  # type: ignore[attr-defined]
    assert streamed(client, THINKING) == (" Hmm", "Yes", [], "length")
    # Nothing to split: the answer is plain content, and no reasoning_content is sent.
    plain = chat(client, ranked(HMM, YES)).choices[0].message
    assert plain.content.startswith(" Hmm Yes")  # type: ignore[union-attr]
    assert getattr(plain, "reasoning_content", None) is None


def test_deepseek_r1_reads_reasoning_without_the_opening_tag(clients):
    client = clients["deepseek_r1"]
    message = chat(client, ranked(HMM, END_THINK, YES), max_tokens=3).choices[0].message
    assert (message.reasoning_content, message.content) == (" Hmm", "Yes")  # type: ignore[attr-defined]
    assert streamed(client, ranked(HMM, END_THINK, YES), max_tokens=3)[:2] == (" Hmm", "Yes")


def test_gpt_oss_reads_harmony_channels(clients):
    client = clients["gpt_oss"]
    # The markers are special tokens: the parser's plan keeps them in the text it reads.
    message = chat(client, HARMONY, max_tokens=6).choices[0].message
    assert (message.reasoning_content, message.content) == (" Hmm", " Yes")  # type: ignore[attr-defined]
    assert streamed(client, HARMONY, max_tokens=6)[:2] == (" Hmm", " Yes")


def test_enable_thinking_false_reaches_the_template(clients, think_model_dir):
    client = clients["template"]
    kwargs = {"enable_thinking": False}
    closed = chat(client, THINKING, extra_body={"chat_template_kwargs": kwargs})
    # The template wrote its closed block `<think>\n\n</think>\n\n` ...
    tokenizer = Tokenizer.from_dir(think_model_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, template_kwargs=kwargs)
    assert prompt.endswith("assistant\n<think>\n\n</think>\n\n")
    assert closed.usage is not None
    assert closed.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    # ... so the prompt ends outside any reasoning: the answer is all content (the biased
    # tokens, the penalty already on <think> and </think> from the prompt).
    message = closed.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content is not None and message.content.startswith(" Hmm Yes")


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=6)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": Weather.model_json_schema(),
    },
}


def check_forced_call(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    """A named tool_choice after reasoning: the reasoning, then one valid call of get_weather,
    whole and streamed."""
    fields = {
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 60,
    }
    response = chat(client, sampling, **dict(fields))
    message = response.choices[0].message
    assert message.reasoning_content == " Hmm"  # type: ignore[attr-defined]
    assert message.content is None and response.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    Weather.model_validate_json(call.function.arguments)  # type: ignore[union-attr]
    reasoning, content, calls, reason = streamed(client, sampling, **dict(fields))
    assert (reasoning, content, reason) == (" Hmm", "", "tool_calls")
    assert calls == [("get_weather", call.function.arguments)]  # type: ignore[union-attr]


def test_tool_calls_follow_the_reasoning(clients):
    client = clients["template"]
    # The tool grammar holds the answer after </think>: the biased tokens think, then the call.
    check_forced_call(client, THINKING)


def test_structured_output_applies_after_the_reasoning(clients):
    client = clients["template"]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": Weather.model_json_schema()},
    }
    message = (
        chat(client, THINKING, response_format=response_format, max_tokens=40).choices[0].message
    )
    assert message.reasoning_content == " Hmm"  # type: ignore[attr-defined]
    Weather.model_validate_json(message.content or "")
    choice = {"structured_outputs": {"choice": ["sunny", "rainy"]}}
    message = chat(client, THINKING, extra_body=choice, max_tokens=20).choices[0].message
    assert message.reasoning_content == " Hmm"  # type: ignore[attr-defined]
    assert message.content in ("sunny", "rainy")


# The analysis, then the next message's <|start|> and its channel's first token.
HARMONY_THEN = (CHANNEL, ANALYSIS_CHANNEL, MESSAGE, HMM, END, START)
WEATHER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": Weather.model_json_schema()},
}


def test_gpt_oss_structured_output_holds_the_final_channel(clients):
    """The grammar lets the analysis through, then holds the final channel's body to the
    schema (the markers as their own tokens): reasoning and a valid answer, whole and
    streamed."""
    client = clients["gpt_oss"]
    sampling = ranked(*HARMONY_THEN, FINAL)
    fields = {"response_format": WEATHER_FORMAT, "max_tokens": 40}
    response = chat(client, sampling, **dict(fields))
    message = response.choices[0].message
    assert message.reasoning_content == " Hmm"  # type: ignore[attr-defined]
    Weather.model_validate_json(message.content or "")
    assert response.choices[0].finish_reason == "stop"
    assert streamed(client, sampling, **dict(fields)) == (" Hmm", message.content, [], "stop")


def test_gpt_oss_harmony_tool_calls(clients):
    """A named tool_choice holds harmony's output to a commentary message to
    functions.get_weather after the analysis; the `openai` tool parser reads it into
    tool_calls, whole and streamed."""
    check_forced_call(clients["gpt_oss"], ranked(*HARMONY_THEN, COMMENT))


GPT_OSS_TEMPLATE = Path(__file__).parent.parent / "fixtures" / "chat_templates" / "gpt_oss.jinja"


@pytest.fixture(scope="module")
def harmony_gateway(services, think_model_dir, tmp_path_factory):
    """A gateway whose tokenizer service reads gpt-oss's own chat template (the same model and
    vocabulary otherwise), so the tool and reasoning formats come from the template."""
    directory = tmp_path_factory.mktemp("tiny-gpt-oss") / MODEL
    shutil.copytree(think_model_dir, directory)
    shutil.copy(GPT_OSS_TEMPLATE, directory / "chat_template.jinja")
    tokenizer = ServerThread(TokenizerService(str(directory), "127.0.0.1", 0))
    gateway = start_gateway((services[0], tokenizer))
    yield gateway, directory
    gateway.close()
    tokenizer.close()


def test_gpt_oss_template_round_trip(harmony_gateway):
    """gpt-oss's template teaches harmony's calls and reasoning; an earlier call and its result
    go back through it as transformers renders them, and the call it writes back reads as the
    same call."""
    gateway, directory = harmony_gateway
    tokenizer = Tokenizer.from_dir(directory)
    assert (tokenizer.tool_call_format, tokenizer.reasoning_format) == ("openai", "gpt_oss")
    arguments = {"city": "Paris"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    conversation: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    reference = AutoTokenizer.from_pretrained(directory)
    call["function"]["arguments"] = arguments  # as transformers takes them
    expected = reference.apply_chat_template(
        conversation, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    written = (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
    )
    assert written in expected
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>'
        in expected
    )
    [read] = parse_whole(HarmonyToolParser(), written).calls
    assert (read.name, json.loads(read.arguments)) == ("get_weather", arguments)
    # Through the gateway, the call's arguments as the openai client sends them (JSON text).
    call["function"]["arguments"] = json.dumps(arguments)
    response = _client(gateway).chat.completions.create(
        model=MODEL,
        messages=conversation,  # type: ignore[arg-type]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=1,
    )
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(reference.encode(expected, add_special_tokens=False))


def greedy_answer(client: openai.OpenAI):
    """The chat API's split of the random model's greedy 5 tokens (no bias)."""
    return chat(client, {}, max_tokens=5).choices[0].message


def test_responses_emit_reasoning_items_and_events(clients):
    """Responses take no logit_bias: deepseek_r1 reads a random answer as reasoning (it starts
    there); the items and events must carry what the chat API splits of the same answer."""
    client = clients["deepseek_r1"]
    expected = greedy_answer(client)
    assert expected.reasoning_content  # type: ignore[attr-defined]
    response = client.responses.create(
        model=MODEL, input="Hi", temperature=0.0, max_output_tokens=5
    )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text == expected.reasoning_content  # type: ignore[union-attr, attr-defined]
    assert message.content[0].text == (expected.content or "")  # type: ignore[union-attr]
    with client.responses.stream(
        model=MODEL, input="Hi", temperature=0.0, max_output_tokens=5
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert deltas == expected.reasoning_content  # type: ignore[attr-defined]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == deltas  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    # The reasoning item sent back as input is accepted (and not fed to the model again).
    follow_up = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hi"},
            final.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": "Again"},
        ],
        max_output_tokens=1,
    )
    assert follow_up.status == "incomplete"


def test_anthropic_thinking_blocks(gateways, clients):
    """thinking enabled: the reasoning as a thinking block, whole and streamed; disabled: the
    template is asked not to think (enable_thinking false) and nothing is split; absent: the
    reasoning is left out."""
    chat_client = clients["deepseek_r1"]
    expected = greedy_answer(chat_client)
    client = anthropic.Anthropic(
        base_url=gateways["deepseek_r1"].url, api_key="unused", max_retries=0, timeout=4 * TIMEOUT
    )
    fields: dict[str, Any] = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "extra_body": {"temperature": 0.0}
    }  # fmt: skip
    enabled = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(**fields, thinking=enabled)  # type: ignore[arg-type]
    thought, text = message.content
    assert thought.type == "thinking" and text.type == "text"
    assert thought.thinking == expected.reasoning_content  # type: ignore[attr-defined]
    assert text.text == (expected.content or "")
    with client.messages.stream(**fields, thinking=enabled) as stream:  # type: ignore[arg-type]
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    assert "content_block_start" in kinds and kinds[-1] == "message_stop"
    # Not asked for: the answer alone.
    [answer] = client.messages.create(**fields).content  # type: ignore[arg-type]
    assert answer.type == "text" and answer.text == (expected.content or "")
    # Disabled: the closed <think></think> block is in the prompt; the answer is not split.
    closed = chat_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=5,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    disabled = client.messages.create(**fields, thinking={"type": "disabled"})  # type: ignore[arg-type]
    assert disabled.usage.input_tokens == closed.usage.prompt_tokens  # type: ignore[union-attr]
    assert [b.text for b in disabled.content] == [closed.choices[0].message.content]  # type: ignore[union-attr]
    # Earlier thinking sent back in the conversation is accepted.
    history = [
        *MESSAGES,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": "Again"},
    ]
    again = client.messages.create(**{**fields, "max_tokens": 1, "messages": history})
    assert again.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(**fields, thinking={"type": "enabled"})  # type: ignore[arg-type]


def test_response_events_split_reasoning_from_the_answer():
    """The Responses event writer over a scripted delta stream (marker split across deltas):
    a reasoning item, then the message, each opened, written and closed in order."""
    body = rapi.ResponsesRequest(input="Hi", stream=True)
    head = ResponseHead.of(body, "tiny")
    pieces = ["<think>Let me", " think</th", "ink>\n\nThe", " answer"]

    async def deltas():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield (
                0,
                TextDelta(
                    text=text,
                    finish_reason="stop" if last else None,
                    usage=Usage(3, 4, 0) if last else None,
                ),
            )

    async def run() -> list[dict[str, Any]]:
        stream = deltas()
        first = await anext(stream)
        plan = ReasoningPlan("qwen3", in_reasoning=False)
        chunks = [c async for c in response_events.events(head, None, plan, first, stream)]
        return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]

    events = asyncio.run(run())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    output = events[-1]["response"]["output"]
    assert output[0]["type"] == "reasoning"
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me think"}]
    assert output[1]["content"][0]["text"] == "The answer"
    assert events[6]["text"] == "Let me think" and events[6]["output_index"] == 0
    assert events[11]["output_index"] == 1


def test_an_unknown_parser_is_refused_at_start_up():
    result = subprocess.run(
        gateway_command("127.0.0.1:1", "127.0.0.1:1", "--reasoning-parser", "r2"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode != 0
    assert "--reasoning-parser" in result.stderr
    assert "'deepseek_r1', 'qwen3', 'gpt_oss', 'none'" in result.stderr
