"""Tool calling on a chat request: what the conversation and tools become for the tokenizer
(through the chat template when it knows tools, else the generic format), the grammar that
constrains the output (tool_choice required or named; auto in the generic format), and a
reader per choice that turns the generated text into content and calls.

Decides what a request's tools mean; never talks to a service (the template's tool format is
read by the caller) and never builds a response body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.sampling_params import StructuredOutput
from gateway.messages import ChatTurn, ToolCall, ToolSpec
from gateway.openai import protocol as api
from gateway.openai.tools import generic
from gateway.openai.tools.grammar import (
    NO_MARKERS,
    MarkerTokens,
    ToolGrammar,
    parameters_schema,
    tool_grammar,
)
from gateway.openai.tools.parsers import PARSERS, CallStart, ContentDelta, ToolCallParser, ToolEvent


@dataclass(frozen=True)
class ToolPlan:
    """How the answers of a request with tools are read."""

    parser: type[ToolCallParser]
    parallel: bool
    grammar: ToolGrammar | None  # the constraint on the output, when there is one


@dataclass
class ChatInput:
    """What goes to the tokenizer, and how the output is constrained and read."""

    messages: list[ChatTurn]
    tools: list[ToolSpec] = field(default_factory=list)  # for the template
    plan: ToolPlan | None = None  # None: the answers are plain text

    @property
    def constraint(self) -> StructuredOutput | None:
        if self.plan is None or self.plan.grammar is None:
            return None
        return self.plan.grammar.constraint


def _choice(body: api.ChatCompletionRequest) -> tuple[str, int | None]:
    """tool_choice as none, auto, required or named, and the named tool's index."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice != "none" and not tools:
        raise api.InvalidParameter("tool_choice needs tools to choose from", "tool_choice")
    if isinstance(choice, api.NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if choice.function.name not in names:
            raise api.InvalidParameter(
                f"tool_choice names the function {choice.function.name!r}, which is not "
                f"among the tools ({', '.join(names)})",
                "tool_choice",
            )
        return "named", names.index(choice.function.name)
    return choice, None


def _check_tools(tools: list[api.ToolDefinition]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise api.InvalidParameter(
                f"tools[{i}]: the function name {tool.function.name!r} is used twice",
                f"tools[{i}]",
            )
        seen.add(tool.function.name)
        if parameters_schema(tool).get("type", "object") != "object":
            raise api.InvalidParameter(
                f"tools[{i}].function.parameters must be a schema of type object", f"tools[{i}]"
            )


def _check_messages(messages: list[api.ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            raise api.InvalidParameter(
                f"messages[{i}]: a message with role 'tool' needs tool_call_id", "messages"
            )
        if message.tool_calls and message.role != "assistant":
            raise api.InvalidParameter(
                f"messages[{i}]: only an assistant message has tool_calls", "messages"
            )


def _template_message(message: api.ChatMessage) -> ChatTurn:
    # Templates know the roles system, user, assistant and tool.
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    return ChatTurn(
        role=role,
        content=message.text,
        name=message.name,
        tool_call_id=message.tool_call_id,
        tool_calls=tuple(
            ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []
        ),
    )


def _template_tool(tool: api.ToolDefinition) -> ToolSpec:
    return ToolSpec(
        name=tool.function.name,
        parameters=json.dumps(parameters_schema(tool)),
        description=tool.function.description,
    )


def tool_family(template_format: str, tool_call_parser: str | None) -> str:
    """The tool-call format answers are read in: the server's --tool-call-parser, else the
    template's ("" for none: the generic format)."""
    return tool_call_parser or template_format


def chat_input(
    body: api.ChatCompletionRequest,
    template_format: str,
    tool_call_parser: str | None,
    markers: MarkerTokens = NO_MARKERS,
) -> ChatInput:
    """The request's conversation and tools for the tokenizer. `template_format`: the tool
    format the model's chat template knows ("" for none); `tool_call_parser`: the server's
    --tool-call-parser, which overrides it (the template must then know tools); `markers`:
    the format's marker tokens, for its grammar (harmony's)."""
    tools = body.tools or []
    _check_tools(tools)
    _check_messages(body.messages)
    choice, named = _choice(body)
    family = tool_family(template_format, tool_call_parser)
    through_template = bool(family)
    if through_template:  # the template writes the tools and the calls
        messages = [_template_message(m) for m in body.messages]
        if choice == "none":
            return ChatInput(messages)
        forced = choice in ("required", "named")
    else:
        family = generic.PARSER
        if choice == "none":
            return ChatInput(generic.conversation(body.messages, None))
        named_tool = tools[named].function.name if named is not None else ""
        messages = generic.conversation(
            body.messages, generic.tools_prompt(tools, choice, named_tool)
        )
        forced = True  # auto too: the grammar keeps a call valid
    grammar = None
    if forced:
        indices = [named] if named is not None else list(range(len(tools)))
        grammar = tool_grammar(
            family,
            tools,
            indices,
            parallel=body.parallel_tool_calls and named is None,
            allow_answer=choice == "auto",
            markers=markers,
        )
    plan = ToolPlan(PARSERS[family], body.parallel_tool_calls, grammar)
    template_tools = [_template_tool(t) for t in tools] if through_template else []
    return ChatInput(messages, template_tools, plan)


class ToolReader:
    """One choice's answer read as it is generated: content text and calls (only the first
    without parallel calls); without a plan (no tools), content only."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self._parser = plan.parser() if plan is not None else None
        self._parallel = plan.parallel if plan is not None else False
        self.num_calls = 0

    def read(self, text: str, final: bool) -> list[ToolEvent]:
        if self._parser is None:
            return [ContentDelta(text)] if text else []
        events = self._parser.feed(text)
        if final:
            events += self._parser.finish()
        if not self._parallel:
            events = [e for e in events if isinstance(e, ContentDelta) or e.index == 0]
        self.num_calls += sum(isinstance(e, CallStart) for e in events)
        return events

    def finish_reason(self, reason: str) -> str:
        """The engine's reason as OpenAI says it: calls that ended normally are "tool_calls";
        a call cut off by max_tokens still ends with "length"."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason
