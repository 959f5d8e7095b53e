"""The tool-call formats on their own: each family's parser on canned model text (read whole and
read a character at a time, which must agree), and each family's shipped chat template
(tests/fixtures/chat_templates) on a tiny random model with SmolLM2's vocabulary: the tokenizer
detects its format and renders the tools and an earlier call as transformers does (the family's
parser reads the call back), and the family's grammar, compiled by the engine, makes the model
write calls that its parser reads and that satisfy their schemas."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.llm import LLM
from gateway.openai import protocol as api
from gateway.openai.tools.grammar import tool_grammar
from gateway.openai.tools.parsers import PARSERS, ArgumentsDelta, CallStart, collect, parse_whole
from tiny_models import make_tiny_smollm2

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
FAMILIES = {"qwen2_5": "hermes", "llama3_1": "llama3_json", "mistral_v0_3": "mistral"}


def read_in_pieces(name: str, text: str):
    parser = PARSERS[name]()
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    return events, collect(events)


def calls_of(answer) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in answer.calls]


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            "{}}\n</tool_call>",
            "Let me look.\n",
            [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})],
        ),
        # Keys in another order: the call comes out whole once its object is complete.
        (
            "hermes",
            '<tool_call>{"arguments": {"a": "}"}, "name": "f"}</tool_call>',
            "",
            [("f", {"a": "}"})],
        ),
        ("hermes", "No calls: a < b and <tool is not a tag.", None, []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"q": "x;y"}}; {"name": "g", '
            '"parameters": {}}',
            "",
            [("f", {"q": "x;y"}), ("g", {})],
        ),
        ("llama3_json", ' {"name": "f", "parameters": {"n": 3}}', "", [("f", {"n": 3})]),
        ("llama3_json", "Plain answer {not a call}", None, []),
        (
            "mistral",
            'Sure [TOOL_CALLS] [{"name": "f", "arguments": {"s": "é]"}}, {"name": "g", '
            '"arguments": {"x": null}}]',
            "Sure ",
            [("f", {"s": "é]"}), ("g", {"x": None})],
        ),
        # skip_special_tokens drops [TOOL_CALLS]: the bare list is read as calls.
        ("mistral", '[{"name": "f", "arguments": {}}]', "", [("f", {})]),
        ("mistral", "[a link](https://example.org)", None, []),
    ],
)
def test_parsers_read_canned_text_whole_and_in_pieces(name, text, content, calls):
    whole = parse_whole(PARSERS[name](), text)
    events, pieces = read_in_pieces(name, text)
    assert whole.content == pieces.content == (text if content is None else content)
    assert calls_of(whole) == calls_of(pieces) == calls
    # Arguments are the model's own text.
    for call in pieces.calls:
        assert call.arguments in text
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [s.name for s in starts] == [c[0] for c in calls]
    ids = [c.id for c in pieces.calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":  # its templates accept nothing else
        assert all(len(i) == 9 and i.isalnum() for i in ids)


def test_arguments_stream_as_they_are_written():
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": 2}}\n</tool_call>'
    events, answer = read_in_pieces("hermes", text)
    start, *rest = events
    assert isinstance(start, CallStart) and start.name == "f"
    # Fed a character at a time: the arguments come a character at a time too.
    assert all(isinstance(e, ArgumentsDelta) for e in rest)
    assert len(rest) == len(answer.calls[0].arguments)


def test_a_call_cut_off_keeps_what_was_written():
    answer = parse_whole(PARSERS["hermes"](), '<tool_call>\n{"name": "f", "arguments": {"a": "ab')
    assert [(c.name, c.arguments) for c in answer.calls] == [("f", '{"a": "ab')]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=6)
    unit: str = Field(pattern=r"^(c|f)$")


TOOLS = [
    api.ToolDefinition.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 6},
                        "unit": {"enum": ["c", "f"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
        }
    )
]
OPENAI_TOOLS = [tool.model_dump(exclude_none=True) for tool in TOOLS]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory, default_model_dir) -> Path:
    return make_tiny_smollm2(tmp_path_factory.mktemp("tiny-tools"), default_model_dir)


def family_dir(weights_dir: Path, default_model_dir: Path, template: str, tmp_path: Path) -> Path:
    directory = tmp_path / template
    shutil.copytree(weights_dir, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, directory / name)
    shutil.copy(TEMPLATES / f"{template}.jinja", directory / "chat_template.jinja")
    return directory


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_family_templates_and_grammars_on_a_tiny_model(
    template, weights_dir, default_model_dir, tmp_path
):
    family = FAMILIES[template]
    directory = family_dir(weights_dir, default_model_dir, template, tmp_path)
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.tool_call_format == family

    # The template writes the tools, an earlier call and its result.
    call_id = "abcDEF123"  # Mistral's templates want 9 letters or digits
    arguments = {"city": "Paris", "unit": "c"}
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "21 degrees"},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "And in Rome?"},
    ]
    prompt = tokenizer.apply_chat_template(conversation, tools=OPENAI_TOOLS)
    assert "Weather in a city." in prompt and "21 degrees" in prompt
    reference = AutoTokenizer.from_pretrained(directory)
    assert prompt == reference.apply_chat_template(
        conversation, tools=OPENAI_TOOLS, tokenize=False, add_generation_prompt=True
    )
    without_tools = tokenizer.apply_chat_template(conversation[:1])
    assert "get_weather" not in without_tools
    # The family's parser reads the call as the template wrote it.
    assistant = tokenizer.apply_chat_template(conversation[:2], add_generation_prompt=False)
    written = assistant[len(tokenizer.apply_chat_template(conversation[:1])) :]
    assert calls_of(parse_whole(PARSERS[family](), written)) == [("get_weather", arguments)]

    # Forced calls: the engine compiles the family's grammar; the model's calls parse and
    # validate, however random its weights.
    grammar = tool_grammar(family, TOOLS, [0], parallel=False, allow_answer=False)
    ids = tokenizer.encode_chat(conversation, tools=OPENAI_TOOLS)
    params = SamplingParams(
        n=4, temperature=1.0, seed=0, max_tokens=60, structured_output=grammar.constraint
    )
    with LLM(str(directory), dtype="float32", num_kv_blocks=256, max_num_seqs=4) as llm:
        outputs = llm.generate([ids], params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        answer = parse_whole(PARSERS[family](), output.text)
        (call,) = answer.calls  # one call: parallel calls are off
        assert call.name == "get_weather" and not answer.content.strip()
        Weather.model_validate_json(call.arguments)
