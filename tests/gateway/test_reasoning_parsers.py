"""The reasoning parsers on text (gateway/openai/reasoning/): each format split into reasoning
and answer, whole and fed in pieces cut at every place (a marker split across deltas), the
prompt's open or closed <think> block, tools read from the answer only (harmony's own calls
too, gateway/openai/tools/harmony.py), and the structured output grammars after the reasoning
(harmony's tool grammar too) compiled and run by llguidance over a real tokenizer."""

from __future__ import annotations

import llguidance
import pytest

from common.sampling_params import StructuredOutput
from common.tokenizer import reasoning_format, tool_call_format
from gateway.openai import protocol as api
from gateway.openai.reasoning.grammar import after_reasoning
from gateway.openai.reasoning.parsers import PARSERS, ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan, reasoning_plan
from gateway.openai.reasoning.reader import AnswerReader, read_whole
from gateway.openai.tools.chat import ToolPlan
from gateway.openai.tools.grammar import NO_MARKERS, tool_grammar
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
    # gpt-oss's template writes earlier calls ending with <|call|>: harmony's tool format.
    harmony_calls = "{% if tools %}...{% endif %}<|channel|>commentary json<|message|>{}<|call|>"
    assert tool_call_format(harmony_calls) == "openai"


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


TEXT = NO_MARKERS


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="module")
def lltokenizer(default_model_dir) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer((default_model_dir / "tokenizer.json").read_text())


# (constraint, an answer it accepts, one it refuses)
CONSTRAINTS = [
    (StructuredOutput(json='{"type": "object", "properties": {"a": {"type": "integer"}}, '
                      '"required": ["a"], "additionalProperties": false}'),
     '{"a": 7}', '{"a": "x"}'),
    (StructuredOutput(regex="[0-9]+/[0-9]+"), "3/4", "3-4"),
    (StructuredOutput(choice=("yes", "no")), "no", "maybe"),
    (StructuredOutput(grammar='start: "x" NUM\nNUM: /[0-9]+/'), "x42", "y42"),
    (StructuredOutput(json_object=True), '{"k": [1]}', "[1]"),
]  # fmt: skip


@pytest.mark.parametrize(("constraint", "answer", "wrong"), CONSTRAINTS)
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


# Harmony: a call after the analysis, with a commentary preamble (content) before it.
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need weather; to=functions.x is not a call here.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
HARMONY_TOOLS = ToolPlan(TOOL_PARSERS["openai"], parallel=True, grammar=None)


def _read_harmony(reasoning: ReasoningPlan | None, pieces: list[str]) -> tuple:
    """Reasoning, content and calls (name, arguments) of harmony text fed in `pieces`."""
    reader = AnswerReader(HARMONY_TOOLS, reasoning)
    events = [e for i, p in enumerate(pieces) for e in reader.read(p, i == len(pieces) - 1)]
    calls = [[e.name, ""] for e in events if isinstance(e, CallStart)]
    for e in events:
        if isinstance(e, ArgumentsDelta):
            calls[e.index][1] += e.text
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
        [tuple(c) for c in calls],
        reader.finish_reason("stop"),
    )


@pytest.mark.parametrize(
    ("reasoning", "expected"),
    [
        (
            ReasoningPlan("gpt_oss", False),
            ("Need weather; to=functions.x is not a call here.", "Checking.",
             [("get_weather", '{"city": "Paris"}')], "tool_calls"),
        ),
        # No reasoning parser: the analysis is content too, the call still a call.
        (
            None,
            ("", "Need weather; to=functions.x is not a call here.Checking.",
             [("get_weather", '{"city": "Paris"}')], "tool_calls"),
        ),
    ],
)  # fmt: skip
def test_harmony_calls_whole_and_at_every_cut(reasoning: ReasoningPlan | None, expected) -> None:
    answer, reader = read_whole(HARMONY_TOOLS, reasoning, HARMONY_CALL)
    whole = (
        answer.reasoning or "",
        answer.parsed.content,
        [(c.name, c.arguments) for c in answer.parsed.calls],
        reader.finish_reason("stop"),
    )
    assert whole == expected
    text = HARMONY_CALL
    for cut in range(len(text) + 1):
        assert _read_harmony(reasoning, [text[:cut], text[cut:]]) == expected, cut
    assert _read_harmony(reasoning, [*text, ""]) == expected
    # The engine stops at <|call|> (gpt-oss's end of turn) and may leave it out of the text.
    assert _read_harmony(reasoning, [text.removesuffix("<|call|>"), ""]) == expected


def test_harmony_without_calls_reads_as_before() -> None:
    """Final answers, headers cut off, plain text: no calls, content as the reasoning parser
    alone reads it."""
    for _, _, text, reasoning, content in [c for c in CASES if c[0] == "gpt_oss"]:
        got = _read_harmony(ReasoningPlan("gpt_oss", False), [*text, ""])
        assert got == (reasoning, content, [], "stop"), text
    # Text and a message to another recipient (a built-in tool) are no calls.
    text = "<|channel|>analysis to=browser.search<|message|>{}<|call|>"
    assert _read_harmony(None, [text]) == ("", "{}", [], "stop")
    # Text that only begins like a recipient is content.
    assert _read_harmony(None, ["to", "=be or not"]) == ("", "to=be or not", [], "stop")


# The recipient after the role, where the prompt's `<|start|>assistant` leaves the model (the
# way gpt-oss's chat template writes earlier calls): the first header begins with it.
ROLE_RECIPIENT = ' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'


def test_a_recipient_after_the_role_at_every_cut() -> None:
    expected = ("", "", [("get_time", '{"tz": "UTC"}')], "tool_calls")
    text = ROLE_RECIPIENT
    for reasoning in (ReasoningPlan("gpt_oss", False), None):
        for cut in range(len(text) + 1):
            assert _read_harmony(reasoning, [text[:cut], text[cut:]]) == expected, cut
        later = "<|channel|>analysis<|message|>a<|end|><|start|>assistant" + text
        assert _read_harmony(reasoning, [*later, ""])[2:] == expected[2:]
    # Without harmony's tool parser (no tools), the reasoning parser reads a call as answer.
    answer, _ = read_whole(None, ReasoningPlan("gpt_oss", False), text)
    assert (answer.reasoning, answer.parsed.content) == (None, '{"tz": "UTC"}')


HARMONY_MARKERS = [
    "<|channel|>analysis<|message|>Free {text}, <|end and to=functions.f\n<|end|>",
    "<|start|>assistant",
    "<|channel|>",
]


@pytest.mark.parametrize(("constraint", "answer", "wrong"), CONSTRAINTS)
def test_the_harmony_grammar_holds_the_final_channel(
    lltokenizer: llguidance.LLTokenizer, constraint: StructuredOutput, answer: str, wrong: str
) -> None:
    # SmolLM2 has no harmony tokens: the markers are text.
    grammar = after_reasoning(ReasoningPlan("gpt_oss", False), constraint, TEXT).grammar
    assert grammar is not None
    analysis, start, channel = HARMONY_MARKERS
    final = f"{channel}final<|message|>"
    assert _accepts(lltokenizer, grammar, f"{analysis}{start}{final}{answer}")
    assert _accepts(lltokenizer, grammar, f"{analysis}{start}{final}{answer}<|return|>")
    assert _accepts(lltokenizer, grammar, f"{final}{answer}")  # no analysis at all
    assert _accepts(lltokenizer, grammar, f"{analysis}{start}{analysis}{start}{final}{answer}")
    assert not _accepts(lltokenizer, grammar, f"{analysis}{start}{final}{wrong}")
    assert not _accepts(lltokenizer, grammar, f"{analysis}{answer}")  # the final header first
    assert not _accepts(lltokenizer, grammar, answer)


def test_the_harmony_tool_grammar_holds_calls_after_the_analysis(
    lltokenizer: llguidance.LLTokenizer,
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [
        api.ToolDefinition.model_validate(
            {"type": "function", "function": {"name": name, "parameters": schema}}
        )
        for name in ("get_weather", "get_time")
    ]
    tool = tool_grammar("openai", tools, [1], parallel=False, allow_answer=False)
    assert tool.covers_reasoning and tool.constraint.source == "tools[1]"
    grammar = tool.constraint.grammar
    assert grammar is not None
    analysis, start, channel = HARMONY_MARKERS
    call = (
        f'{channel}commentary to=functions.get_time <|constrain|>json<|message|>{{"city": "Oslo"}}'
    )
    assert _accepts(lltokenizer, grammar, f"{analysis}{start}{call}<|call|>")
    assert _accepts(lltokenizer, grammar, f"{call}<|call|>")
    assert not _accepts(lltokenizer, grammar, f"{call}")  # ended by <|call|>
    assert not _accepts(lltokenizer, grammar, call.replace("get_time", "get_weather") + "<|call|>")
    assert not _accepts(lltokenizer, grammar, call.replace('"Oslo"', "1") + "<|call|>")
    assert not _accepts(lltokenizer, grammar, f"{analysis}{start}{channel}final<|message|>Hi")
    # Reading what it allows gives the call.
    answer, _ = read_whole(HARMONY_TOOLS, ReasoningPlan("gpt_oss", False), f"{analysis}{call}")
    assert [(c.name, c.arguments) for c in answer.parsed.calls] == [
        ("get_time", '{"city": "Oslo"}')
    ]
