"""The reasoning parsers on text (gateway/openai/reasoning/): each format split into reasoning
and answer, whole and fed in pieces cut at every place (a marker split across deltas), the
prompt's open or closed <think> block, tools read from the answer only, and the structured
output grammar after the reasoning compiled and run by llguidance over a real tokenizer."""

from __future__ import annotations

import llguidance
import pytest

from common.sampling_params import StructuredOutput
from common.tokenizer import reasoning_format
from gateway.openai import protocol as api
from gateway.openai.reasoning.grammar import MarkerTokens, after_reasoning
from gateway.openai.reasoning.parsers import PARSERS, ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan, reasoning_plan
from gateway.openai.reasoning.reader import AnswerReader, read_whole
from gateway.openai.tools.chat import ToolPlan
from gateway.openai.tools.parsers import PARSERS as TOOL_PARSERS
from gateway.openai.tools.parsers import ArgumentsDelta, CallStart, ContentDelta

HARMONY = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)

CASES = [
    # (parser, in_reasoning, text, reasoning, content)
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nThe answer.", "\nLet me see.\n",
     "The answer."),
    ("qwen3", False, "Just an answer, <think> later.", "", "Just an answer, <think> later."),
    ("qwen3", True, "Still thinking</think>Done", "Still thinking", "Done"),
    ("qwen3", False, "  <think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("deepseek_r1", True, "No tag here</think>\nAnswer <think>x</think>", "No tag here",
     "Answer <think>x</think>"),
    ("deepseek_r1", True, "<think>tagged</think>A", "tagged", "A"),
    ("deepseek_r1", True, "thinking forever", "thinking forever", ""),
    ("gpt_oss", False, HARMONY, "User asks 2+2. Easy.", "It is 4."),
    ("gpt_oss", False, "<|channel|>final<|message|>Only final", "", "Only final"),
    ("gpt_oss", False, "plain text, no harmony", "", "plain text, no harmony"),
    ("gpt_oss", False, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
     "analysis<|message|>b<|end|><|start|>assistant<|channel|>final<|message|>c", "ab", "c"),
]  # fmt: skip


def _split(parser_name: str, in_reasoning: bool, pieces: list[str]) -> tuple[str, str]:
    reader = AnswerReader(None, ReasoningPlan(parser_name, in_reasoning))
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        for event in reader.read(piece, final=i == len(pieces) - 1):
            if isinstance(event, ReasoningDelta):
                reasoning += event.text
            else:
                assert isinstance(event, ContentDelta)
                content += event.text
    return reasoning, content


@pytest.mark.parametrize(("name", "in_reasoning", "text", "reasoning", "content"), CASES)
def test_split_whole_and_at_every_cut(
    name: str, in_reasoning: bool, text: str, reasoning: str, content: str
) -> None:
    answer, _ = read_whole(None, ReasoningPlan(name, in_reasoning), text)
    assert (answer.reasoning or "", answer.parsed.content) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _split(name, in_reasoning, [text[:cut], text[cut:]]) == (reasoning, content), cut
    # One character at a time, the last piece empty (the finish alone).
    assert _split(name, in_reasoning, [*text, ""]) == (reasoning, content)


def test_nothing_is_held_back_but_a_marker_start() -> None:
    reader = AnswerReader(None, ReasoningPlan("qwen3", False))
    assert reader.read("<thi", False) == []
    assert reader.read("nk>abc </th", False) == [ReasoningDelta("abc ")]
    assert reader.read("ink>", False) == []  # whitespace after </think> is the template's
    assert reader.read("x", False) == [ContentDelta("x")]


def test_the_prompt_decides_where_the_answer_starts() -> None:
    assert reasoning_plan(None, "", "hi") is None
    assert reasoning_plan("none", "qwen3", "<think>") is None
    assert reasoning_plan(None, "qwen3", "user: hi\nassistant:") == ReasoningPlan("qwen3", False)
    assert reasoning_plan(None, "qwen3", "assistant\n<think>\n") == ReasoningPlan("qwen3", True)
    # enable_thinking false: the template wrote an empty, closed block: no reasoning to split.
    assert reasoning_plan(None, "qwen3", "assistant\n<think>\n\n</think>\n\n") is None
    assert reasoning_plan(None, "", "x") is None
    assert reasoning_plan("deepseek_r1", "", "Assistant:") == ReasoningPlan("deepseek_r1", True)
    assert reasoning_plan("gpt_oss", "", "<|start|>assistant") == ReasoningPlan("gpt_oss", False)
    assert set(PARSERS) == {"deepseek_r1", "qwen3", "gpt_oss"}


def test_reasoning_format_from_the_chat_template() -> None:
    assert reasoning_format(None) == ""
    assert reasoning_format("{{ messages }}") == ""
    assert reasoning_format("<|im_start|>assistant\n<think>\n") == "qwen3"
    assert reasoning_format("<\uff5cAssistant\uff5c><think>\n") == "deepseek_r1"  # DeepSeek's bars
    assert reasoning_format("<|start|>assistant<|channel|>final<|message|>") == "gpt_oss"


def test_tool_calls_are_read_from_the_answer_only() -> None:
    tools = ToolPlan(TOOL_PARSERS["hermes"], parallel=True, grammar=None)
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text = f"<think>maybe {call}? no</think>\n{call}"
    answer, reader = read_whole(tools, ReasoningPlan("qwen3", False), text)
    assert answer.reasoning == f"maybe {call}? no"
    assert answer.parsed.content == ""
    assert [(c.name, c.arguments) for c in answer.parsed.calls] == [("f", '{"x": 1}')]
    assert reader.finish_reason("stop") == "tool_calls"
    # Streamed in small pieces: the same events' text.
    reader = AnswerReader(tools, ReasoningPlan("qwen3", False))
    events = [e for i in range(0, len(text), 3) for e in reader.read(text[i : i + 3], False)]
    events += reader.read("", True)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == answer.reasoning
    assert [e.name for e in events if isinstance(e, CallStart)] == ["f"]
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == '{"x": 1}'


TEXT = MarkerTokens(None, None)


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="module")
def lltokenizer(default_model_dir) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((default_model_dir / "tokenizer.json").read_text())


@pytest.mark.parametrize(
    ("constraint", "answer", "wrong"),
    [
        (StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "integer"}}, '
                          '"required": ["a"], "additionalProperties": false}'),
         '{"a": 7}', '{"a": "x"}'),
        (StructuredOutput(regex="[0-9]+/[0-9]+"), "3/4", "3-4"),
        (StructuredOutput(choice=("yes", "no")), "no", "maybe"),
        (StructuredOutput(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x42", "y42"),
        (StructuredOutput(json_object=True), '{"k": [1]}', "[1]"),
    ],
)  # fmt: skip
def test_the_grammar_applies_after_the_reasoning(
    lltokenizer: llguidance.LLTokenizer, constraint: StructuredOutput, answer: str, wrong: str
) -> None:
    # SmolLM2 has no <think> token: the markers are text.
    in_block = after_reasoning(ReasoningPlan("deepseek_r1", True), constraint, TEXT).grammar
    assert in_block is not None
    thought = "Free {text}, with </th and <think> inside\n"
    assert _accepts(lltokenizer, in_block, f"{thought}</think>{answer}")
    assert not _accepts(lltokenizer, in_block, f"{thought}</think>{wrong}")
    assert not _accepts(lltokenizer, in_block, answer)  # the reasoning must end first
    optional = after_reasoning(ReasoningPlan("qwen3", False), constraint, TEXT).grammar
    assert optional is not None
    assert _accepts(lltokenizer, optional, f"<think>{thought}</think>{answer}")
    assert _accepts(lltokenizer, optional, answer)  # no thinking at all
    assert not _accepts(lltokenizer, optional, f"{thought}</think>{answer}")


def test_constraints_the_grammar_cannot_follow_are_refused_by_name() -> None:
    with pytest.raises(api.InvalidParameter) as gbnf:
        after_reasoning(
            ReasoningPlan("qwen3", True),
            StructuredOutput(grammar='root ::= "a"', source="structured_outputs"),
            TEXT,
        )
    assert gbnf.value.param == "structured_outputs"
    with pytest.raises(api.InvalidParameter) as harmony:
        after_reasoning(
            ReasoningPlan("gpt_oss", False),
            StructuredOutput(choice=("a",), source="response_format"),
            TEXT,
        )
    assert harmony.value.param == "response_format" and "gpt_oss" in str(harmony.value)
