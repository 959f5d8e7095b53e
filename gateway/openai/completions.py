"""OpenAI chat and text completions over the generation pipeline: an OpenAI request becomes
TextRequests (one per prompt, each with its n choices), the pipeline's text deltas become a
response body or server-sent events.

Translation between the OpenAI shapes and generation.py only: it never talks to a service
itself and never touches an HTTP connection (app.py does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic_core

from common.errors import InvalidRequestError
from common.generation_config import SamplingDefaults
from common.sampling_params import BATCH_PRIORITY, SamplingParams
from gateway.engines.pinning import set_pin
from gateway.front.http_errors import error_body, log_failure
from gateway.front.sse import DONE, event
from gateway.json_lines import one_line
from gateway.messages import ChatPrompt, ChatTurn, Tokenized
from gateway.openai import protocol as api
from gateway.openai.reasoning.grammar import after_reasoning
from gateway.openai.reasoning.parsers import ReasoningDelta
from gateway.openai.reasoning.plan import ReasoningPlan, reasoning_plan
from gateway.openai.reasoning.reader import AnswerEvent, AnswerReader, read_whole
from gateway.openai.structured import structured_output
from gateway.openai.tools import harmony
from gateway.openai.tools.chat import ChatInput, ToolPlan, chat_input, tool_family
from gateway.openai.tools.grammar import HARMONY, NO_MARKERS, MarkerTokens, ToolGrammar
from gateway.openai.tools.parsers import CallStart, ContentDelta
from gateway.pipeline.generation import Gateway, new_request_id
from gateway.pipeline.text import TextDelta, TextRequest, TokenLogprob, Usage
from gateway.pipeline.validation import ModelInfo, text_request

T = TypeVar("T")

# What a field the request leaves unset (None) becomes: the engine library's default.
_DEFAULT_PARAMS = SamplingParams()


@dataclass
class Plan:
    """A validated completion request: what to run and how to answer."""

    chat: bool
    id: str
    model: str
    requests: list[TextRequest]  # one per prompt; choice i of prompt p is p * n + i
    n: int
    logprobs: bool
    include_usage: bool  # a usage chunk ends the stream
    created: int
    # With echo: per choice, the text that leads its output: a completion's prompt, or a
    # chat's final assistant message (which the answer continues).
    echo: list[str] | None = None
    # With tools (chat): how each answer is read into content and calls.
    tools: ToolPlan | None = None
    # With a reasoning parser (chat): how each answer's reasoning is split from it.
    reasoning: ReasoningPlan | None = None
    # Every chunk carries its choice's usage so far (stream_options.continuous_usage_stats).
    continuous_usage: bool = False
    # Logprobs name tokens "token_id:N" (return_tokens_as_token_ids).
    tokens_as_ids: bool = False
    # The service tier the request ran in, said when it asked for one (service_tier).
    service_tier: str | None = None

    @property
    def envelope(self) -> dict[str, Any]:
        """What every answer and chunk of the plan says besides its choices and usage."""
        return {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "service_tier": self.service_tier,
        }

    @property
    def reads_answers(self) -> bool:
        """Each choice's text is read (into reasoning, content and calls), not sent as is."""
        return self.tools is not None or self.reasoning is not None

    def reader(self) -> AnswerReader:
        return AnswerReader(self.tools, self.reasoning)

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n

    def outputs(
        self, stream: AsyncGenerator[tuple[int, TextDelta], None]
    ) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """The served stream; with a tool grammar, the engine's refusal of it names the tool."""
        if self.tools is None or self.tools.grammar is None:
            return stream
        return _naming_tools(stream, self.tools.grammar)


async def _naming_tools(
    stream: AsyncGenerator[tuple[int, TextDelta], None], grammar: ToolGrammar
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    try:
        async for item in stream:
            yield item
    except InvalidRequestError as exc:
        raise grammar.naming_tool(exc) from None
    finally:
        await stream.aclose()


async def _bad_words_token_ids(gateway: Gateway, words: list[str] | None) -> list[list[int]]:
    """vLLM's bad_words as the token sequences the sampler bans: each word as written (leading
    spaces dropped), and after a space where that spells the same number of tokens (a word's
    form inside the text for most tokenizers; SentencePiece ones would spell an extra token
    for the space instead)."""
    if not words:
        return []
    texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
    tokenized = await asyncio.gather(
        *(gateway.tokenize_text(text, add_special_tokens=False) for text in texts)
    )
    sequences: dict[tuple[int, ...], None] = {}
    for written, spaced in zip(tokenized[::2], tokenized[1::2], strict=True):
        if not written.token_ids:
            raise api.InvalidParameter("bad_words must not hold blank words", "bad_words")
        sequences[tuple(written.token_ids)] = None
        if len(spaced.token_ids) == len(written.token_ids):
            sequences[tuple(spaced.token_ids)] = None
    return [list(sequence) for sequence in sequences]


def _sampling_params(
    body: api.SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    model: SamplingDefaults,
    prompt_logprobs: int | None = None,
    bad_words_token_ids: list[list[int]] | None = None,
) -> SamplingParams:
    """The request's sampling: what it sets, else what the model recommends (`model`,
    --generation-config), else the library's defaults (the model's max_tokens caps the request's
    where its prompt's length is known: _text_requests). `bad_words_token_ids`: body.bad_words
    tokenized (_bad_words_token_ids)."""
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError:
            raise api.InvalidParameter("logit_bias keys must be token ids", "logit_bias") from None
    default = _DEFAULT_PARAMS
    return SamplingParams(
        n=body.n,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        temperature=_or_default(body.temperature, model.temperature, default.temperature),
        top_p=_or_default(body.top_p, model.top_p, default.top_p),
        top_k=_or_default(body.top_k, model.top_k, default.top_k),
        min_p=_or_default(body.min_p, model.min_p, default.min_p),
        presence_penalty=_or_default(body.presence_penalty, default.presence_penalty),
        frequency_penalty=_or_default(body.frequency_penalty, default.frequency_penalty),
        repetition_penalty=_or_default(
            body.repetition_penalty, model.repetition_penalty, default.repetition_penalty
        ),
        seed=body.seed,
        logit_bias=logit_bias,
        stop_token_ids=_or_default(body.stop_token_ids, []),
        allowed_token_ids=body.allowed_token_ids,
        bad_words_token_ids=bad_words_token_ids or [],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_output=structured_output(body),
    )


def _or_default(value: T | None, *defaults: T | None) -> T:
    """The first of the value and its defaults that is set (the last default always is)."""
    return next(v for v in (value, *defaults) if v is not None)


def _text_requests(
    info: ModelInfo,
    prompts: list[list[int]],
    body: api.SamplingFields,
    params: SamplingParams,
    prompt_param: str,
    max_tokens_param: str,
    model: SamplingDefaults,
) -> list[TextRequest]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return [
        text_request(
            info,
            ids,
            params,
            prompt_param=prompt_param,
            max_tokens_param=max_tokens_param,
            stop=stop,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            priority=_priority(body),
            max_tokens_cap=model.max_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
        for ids in prompts
    ]


def _uses_tools(body: api.ChatCompletionRequest) -> bool:
    return (
        bool(body.tools)
        or body.tool_choice is not None
        or any(
            m.tool_calls or m.tool_call_id is not None or m.role in ("tool", "function")
            for m in body.messages
        )
    )


async def _chat_input(
    gateway: Gateway, body: api.ChatCompletionRequest, tool_call_parser: str | None
) -> ChatInput:
    if not _uses_tools(body):
        return ChatInput(
            [ChatTurn(role=m.role, content=m.text, name=m.name) for m in body.messages]
        )
    template_format = (await gateway.chat_formats()).tool_call
    markers = NO_MARKERS  # harmony's grammar writes its markers as tokens
    if tool_family(template_format, tool_call_parser) == HARMONY:
        markers = await _marker_tokens(gateway, harmony.MARKERS)
    return chat_input(body, template_format, tool_call_parser, markers)


def _with_tools(params: SamplingParams, chat: ChatInput) -> SamplingParams:
    """The tools' grammar on top of the request's own constraint: a forced call cannot also
    follow a response format; under auto the response format wins (and no call is made)."""
    tools = chat.constraint
    if tools is None:
        return params
    if params.structured_output is None:
        return dataclasses.replace(params, structured_output=tools)
    if chat.plan is not None and chat.plan.grammar is not None and chat.plan.grammar.allows_answer:
        chat.plan = dataclasses.replace(chat.plan, grammar=None)
        return params
    raise api.InvalidParameter(
        f"tool_choice forces a call, which {params.structured_output.label} would constrain "
        "too: set only one",
        "tool_choice",
    )


async def chat_prompt(
    gateway: Gateway, body: api.ChatCompletionRequest, tool_call_parser: str | None = None
) -> tuple[ModelInfo, ChatInput, Tokenized]:
    """The served model, the conversation as its chat template sees it, and the prompt's
    tokens: what a chat request runs on, before any check of what it asks to generate.
    `tool_call_parser`: the server's --tool-call-parser, if set."""
    info = await gateway.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise api.InvalidParameter("top_logprobs needs logprobs set to true", "top_logprobs")
    chat = await _chat_input(gateway, body, tool_call_parser)
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    prompt = await gateway.tokenize_chat(
        ChatPrompt(
            chat.messages,
            chat.tools,
            body.add_generation_prompt,
            body.continue_final_message,
            template_kwargs,
        )
    )
    return info, chat, prompt


async def plan_chat(
    gateway: Gateway,
    body: api.ChatCompletionRequest,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> Plan:
    """`reasoning_parser`: the server's --reasoning-parser, if set."""
    info, chat, prompt = await chat_prompt(gateway, body, tool_call_parser)
    set_pin(body.cache.ttl_seconds if body.cache is not None and body.cache.pin_prefix else 0.0)
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    model = await gateway.sampling_defaults()
    params = _sampling_params(
        body,
        body.max_completion_tokens or body.max_tokens,
        (body.top_logprobs or 0) if body.logprobs else None,
        model,
        bad_words_token_ids=await _bad_words_token_ids(gateway, body.bad_words),
    )
    params = _with_tools(params, chat)
    reasoning = reasoning_plan(
        reasoning_parser, (await gateway.chat_formats()).reasoning, prompt.prompt
    )
    # The constraint holds the answer, after the reasoning; harmony's tool grammar (the one
    # constraint then, _with_tools sees to it) lets the model think already.
    tools_grammar = chat.plan.grammar if chat.plan is not None else None
    covered = tools_grammar is not None and tools_grammar.covers_reasoning
    if reasoning is not None and params.structured_output is not None and not covered:
        markers = await _marker_tokens(gateway, reasoning.markers)
        params = dataclasses.replace(
            params, structured_output=after_reasoning(reasoning, params.structured_output, markers)
        )
    # Harmony's markers are special tokens, which its parsers read in the text.
    harmony_calls = chat.plan is not None and chat.plan.parser.name == HARMONY
    if harmony_calls or (reasoning is not None and reasoning.needs_special_tokens):
        body = body.model_copy(update={"skip_special_tokens": False})
    requests = _text_requests(
        info, [prompt.token_ids], body, params, "messages", max_tokens_param, model
    )
    return Plan(
        True,
        new_request_id("chatcmpl"),
        info.name,
        requests,
        body.n,
        body.logprobs,
        _include_usage(body),
        int(time.time()),
        echo=_chat_echo(body),
        tools=chat.plan,
        reasoning=reasoning,
        continuous_usage=_continuous_usage(body),
        tokens_as_ids=body.return_tokens_as_token_ids,
        service_tier=api.TIER_RUN.get(body.service_tier or ""),
    )


def _chat_echo(body: api.ChatCompletionRequest) -> list[str] | None:
    """vLLM's chat echo: a final assistant message leads each choice's content (with
    continue_final_message, the whole message); None without echo or such a message."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return None
    return [last.text] * body.n


async def _marker_tokens(gateway: Gateway, markers: tuple[str, ...]) -> MarkerTokens:
    """The markers' token ids, where the tokenizer holds each as one token."""
    tokenized = await asyncio.gather(
        *(gateway.tokenize_text(m, add_special_tokens=False) for m in markers)
    )
    pairs = zip(markers, tokenized, strict=True)
    return MarkerTokens({m: t.token_ids[0] for m, t in pairs if len(t.token_ids) == 1})


async def plan_completion(gateway: Gateway, body: api.CompletionRequest) -> Plan:
    info = await gateway.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise api.InvalidParameter("prompt must not be empty", "prompt")
    # One prompt (text or token ids) or a batch of them.
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    tokenized = await asyncio.gather(
        *(gateway.tokenize_text(p) for p in prompts if isinstance(p, str))
    )
    texts = iter(tokenized)
    ids = [list(next(texts).token_ids) if isinstance(p, str) else p for p in prompts]
    if body.max_tokens == 0 and not body.echo:
        raise api.InvalidParameter("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
    # Echoed logprobs cover the prompt. max_tokens 0 is a prompt-only (scoring) request, which
    # the engine runs only for prompt logprobs: it gets k = 0 even if none are shown.
    prompt_logprobs = body.logprobs if body.echo else None
    if body.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    model = await gateway.sampling_defaults()
    bad_words = await _bad_words_token_ids(gateway, body.bad_words)
    params = _sampling_params(
        body, body.max_tokens, body.logprobs, model, prompt_logprobs, bad_words
    )
    requests = _text_requests(info, ids, body, params, "prompt", "max_tokens", model)
    echo = None
    if body.echo:  # the prompts as run: truncated ones as their ids
        truncated = body.truncate_prompt_tokens is not None
        echoed = [r.prompt_ids for r in requests] if truncated else prompts
        prompt_texts = await asyncio.gather(*(_prompt_text(gateway, p) for p in echoed))
        echo = [text for text in prompt_texts for _ in range(body.n)]
    return Plan(
        False,
        new_request_id("cmpl"),
        info.name,
        requests,
        body.n,
        body.logprobs is not None,
        _include_usage(body),
        int(time.time()),
        echo,
        continuous_usage=_continuous_usage(body),
        tokens_as_ids=body.return_tokens_as_token_ids,
        service_tier=api.TIER_RUN.get(body.service_tier or ""),
    )


async def _prompt_text(gateway: Gateway, prompt: str | list[int]) -> str:
    """A prompt as echoed: its own text, or the exact text of its token ids."""
    if isinstance(prompt, str):
        return prompt
    return await gateway.tokenizer.detokenize(prompt, skip_special_tokens=False)


def _include_usage(body: api.SamplingFields) -> bool:
    return body.stream_options is not None and (
        body.stream_options.include_usage or body.stream_options.continuous_usage_stats
    )


def _priority(body: api.SamplingFields) -> int:
    """The request's priority: OpenAI's flex tier (slower, for work that can wait) runs in the
    engine's batch lane, behind every interactive request."""
    if body.service_tier == "flex":
        return max(body.priority, BATCH_PRIORITY)
    return body.priority


def _continuous_usage(body: api.SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def _usage_so_far(plan: Plan, index: int, completion_tokens: int) -> api.Usage:
    """Choice `index`'s usage after `completion_tokens` tokens (continuous usage stats)."""
    prompt = len(plan.requests[index // plan.n].prompt_ids)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
    )


def _usage(plan: Plan, usages: list[Usage | None]) -> api.Usage:
    # The prompt counts once per prompt, not once per choice.
    firsts = [u for u in usages[:: plan.n] if u is not None]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages if u is not None)
    drafted = sum(u.draft_tokens for u in usages if u is not None)
    accepted = sum(u.accepted_draft_tokens for u in usages if u is not None)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=api.PromptTokensDetails(
            cached_tokens=sum(u.cached_tokens for u in firsts)
        ),
        completion_tokens_details=api.CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted
        )
        if drafted
        else None,
    )


def _utf8(text: str) -> list[int] | None:
    # A token holding part of a character decodes to U+FFFD: its own bytes are not known here.
    return None if "\ufffd" in text else list(text.encode())


def _token_name(plan: Plan) -> Callable[[int, str], str]:
    """How the plan's logprobs name a token: its text, or with return_tokens_as_token_ids
    "token_id:N" (vLLM's: every token told apart, whatever its text)."""
    if plan.tokens_as_ids:
        return lambda token_id, _text: f"token_id:{token_id}"
    return lambda _token_id, text: text


def _chat_logprobs(plan: Plan, logprobs: list[TokenLogprob]) -> api.ChatLogprobs:
    name = _token_name(plan)
    return api.ChatLogprobs(content=[_chat_token_logprob(lp, name) for lp in logprobs])


def _chat_token_logprob(lp: TokenLogprob, name: Callable[[int, str], str]) -> api.ChatTokenLogprob:
    # A chat answer never echoes its prompt: its tokens are generated ones, which all have a
    # logprob (only a prompt's first token has none).
    if lp.logprob is None:
        raise ValueError(
            f"token {lp.token_id} has no logprob: only a prompt's first token lacks one"
        )
    token = name(lp.token_id, lp.token)
    return api.ChatTokenLogprob(
        token=token,
        logprob=lp.logprob,
        bytes=_utf8(token),
        top_logprobs=[
            api.TopLogprob(token=(top := name(token_id, text)), logprob=value, bytes=_utf8(top))
            for token_id, text, value in lp.top
        ],
    )


def _completion_logprobs(
    plan: Plan, logprobs: list[TokenLogprob], offset: int
) -> api.CompletionLogprobs:
    """Completions' logprobs; text_offset counts the text's characters, however tokens are
    named."""
    name = _token_name(plan)
    out = api.CompletionLogprobs()
    for lp in logprobs:
        out.tokens.append(name(lp.token_id, lp.token))
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(
            None
            if lp.logprob is None
            else {name(token_id, text): value for token_id, text, value in lp.top}
        )
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def _echoed(
    plan: Plan, index: int, delta: TextDelta, first: bool
) -> tuple[str, list[TokenLogprob]]:
    """A delta's text and logprobs; with echo, the prompt's lead a choice's first delta."""
    if plan.echo is None or not first:
        return delta.text, delta.logprobs
    return plan.echo[index] + delta.text, (delta.prompt_logprobs or []) + delta.logprobs


def _chat_choice(
    plan: Plan, index: int, text: str, reason: str | None, logprobs: list[TokenLogprob]
) -> api.ChatChoice:
    message = api.AssistantMessage(content=text)
    if plan.reads_answers:
        whole, reader = read_whole(plan.tools, plan.reasoning, text)
        answer = whole.parsed
        message = api.AssistantMessage(
            content=answer.content if answer.content or not answer.calls else None,
            reasoning_content=whole.reasoning,
            tool_calls=[
                api.ResponseToolCall(
                    id=call.id,
                    function=api.ResponseFunctionCall(name=call.name, arguments=call.arguments),
                )
                for call in answer.calls
            ]
            or None,
        )
        if reason is not None:
            reason = reader.finish_reason(reason)
    return api.ChatChoice(
        index=index,
        message=message,
        logprobs=_chat_logprobs(plan, logprobs) if plan.logprobs else None,
        finish_reason=reason,
    )


def _delta_message(events: list[AnswerEvent]) -> api.DeltaMessage:
    """An answer's events as one streamed delta: reasoning, content, and per call its id and
    name (first) and pieces of its arguments."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[api.DeltaToolCall] = []
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            continue
        if isinstance(e, CallStart):
            calls.append(
                api.DeltaToolCall(
                    index=e.index,
                    id=e.id,
                    type="function",
                    function=api.DeltaFunctionCall(name=e.name),
                )
            )
        elif calls and calls[-1].index == e.index:
            calls[-1].function.arguments += e.text
        else:
            calls.append(
                api.DeltaToolCall(index=e.index, function=api.DeltaFunctionCall(arguments=e.text))
            )
    return api.DeltaMessage(
        content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
    )


class _TextEvents:
    """The events of one streamed response that carry nothing but a choice's text (most of
    them): each choice's event is serialized once with a placeholder where the text goes, then
    each delta only splices in its text as JSON (pydantic_core.to_json, the serializer
    model_dump_json uses), the same bytes as serializing the whole event for a fraction of the
    CPU per token."""

    _SLOT = "\x00folio-text\x00"

    def __init__(self, make: Callable[[int, str], bytes]) -> None:
        """`make(index, text)`: the event, serialized whole."""
        self._make = make
        self._parts: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if index not in self._parts:
            whole = self._make(index, self._SLOT)
            slot = pydantic_core.to_json(self._SLOT)
            # The placeholder cannot come from the request; should it appear twice, no splicing.
            if whole.count(slot) == 1:
                prefix, suffix = whole.split(slot)
                self._parts[index] = (prefix, suffix)
            else:
                self._parts[index] = None
        parts = self._parts[index]
        if parts is None:
            return self._make(index, text)
        return parts[0] + one_line(pydantic_core.to_json(text)) + parts[1]


async def respond(
    plan: Plan, stream: AsyncIterator[tuple[int, TextDelta]]
) -> api.ChatCompletionResponse | api.CompletionResponse:
    """Run the stream to its end; the whole response body."""
    count = plan.num_choices
    texts: list[list[str]] = [[] for _ in range(count)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
    reasons: list[str | None] = [None] * count
    usages: list[Usage | None] = [None] * count
    async for index, delta in stream:
        text, token_logprobs = _echoed(plan, index, delta, first=not texts[index])
        texts[index].append(text)
        logprobs[index] += token_logprobs
        if delta.finish_reason is not None:
            reasons[index], usages[index] = delta.finish_reason, delta.usage
    usage = _usage(plan, usages)
    if plan.chat:
        chat_choices = [
            _chat_choice(plan, i, "".join(texts[i]), reasons[i], logprobs[i]) for i in range(count)
        ]
        return api.ChatCompletionResponse(**plan.envelope, choices=chat_choices, usage=usage)
    choices = [
        api.CompletionChoice(
            index=i,
            text="".join(texts[i]),
            logprobs=_completion_logprobs(plan, logprobs[i], 0) if plan.logprobs else None,
            finish_reason=reasons[i],
        )
        for i in range(count)
    ]
    return api.CompletionResponse(**plan.envelope, choices=choices, usage=usage)


async def events(
    plan: Plan,
    first: tuple[int, TextDelta],
    stream: AsyncGenerator[tuple[int, TextDelta], None],
) -> AsyncGenerator[bytes, None]:
    """Server-sent events: one per text delta (the first already read), usage, [DONE]."""
    count = plan.num_choices
    usages: list[Usage | None] = [None] * count
    offsets = [0] * count  # completions' logprobs.text_offset
    started = [False] * count
    readers = [plan.reader() for _ in range(count)] if plan.reads_answers else None

    def chat_chunk(choices: list[api.ChatChunkChoice], usage: api.Usage | None = None) -> bytes:
        return event(api.ChatCompletionChunk(**plan.envelope, choices=choices, usage=usage))

    def completion_chunk(
        choices: list[api.CompletionChoice], usage: api.Usage | None = None
    ) -> bytes:
        return event(api.CompletionResponse(**plan.envelope, choices=choices, usage=usage))

    def chat_text_chunk(index: int, text: str) -> bytes:
        return chat_chunk([api.ChatChunkChoice(index=index, delta=api.DeltaMessage(content=text))])

    def completion_text_chunk(index: int, text: str) -> bytes:
        return completion_chunk([api.CompletionChoice(index=index, text=text)])

    # Deltas of text alone (no finish reason, logprobs, tool calls to read or usage to add).
    text_chunk = _TextEvents(chat_text_chunk if plan.chat else completion_text_chunk)
    text_only = not plan.logprobs and readers is None and not plan.continuous_usage

    def usage_so_far(index: int, completion_tokens: int) -> api.Usage | None:
        return _usage_so_far(plan, index, completion_tokens) if plan.continuous_usage else None

    def delta_chunk(index: int, delta: TextDelta) -> bytes | None:
        if text_only and delta.finish_reason is None and (plan.echo is None or started[index]):
            return text_chunk(index, delta.text)
        text, token_logprobs = _echoed(plan, index, delta, first=not started[index])
        started[index] = True
        if plan.chat:
            message = api.DeltaMessage(content=text)
            reason = delta.finish_reason
            if readers is not None:
                reader = readers[index]
                message = _delta_message(reader.read(text, reason is not None))
                if reason is not None:
                    reason = reader.finish_reason(reason)
                elif message == api.DeltaMessage() and not token_logprobs:
                    return None  # text held back: nothing to say yet
            return chat_chunk(
                [
                    api.ChatChunkChoice(
                        index=index,
                        delta=message,
                        logprobs=_chat_logprobs(plan, token_logprobs) if plan.logprobs else None,
                        finish_reason=reason,
                    )
                ],
                usage_so_far(index, delta.completion_tokens),
            )
        logprobs = None
        if plan.logprobs:
            logprobs = _completion_logprobs(plan, token_logprobs, offsets[index])
            offsets[index] += sum(len(lp.token) for lp in token_logprobs)
        return completion_chunk(
            [
                api.CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason
                )
            ],
            usage_so_far(index, delta.completion_tokens),
        )

    try:
        if plan.chat:  # OpenAI opens each choice with the assistant's role
            yield chat_chunk(
                [
                    api.ChatChunkChoice(
                        index=i, delta=api.DeltaMessage(role="assistant", content="")
                    )
                    for i in range(count)
                ],
                usage_so_far(0, 0),
            )
        index, delta = first
        while True:
            if delta.finish_reason is not None:
                usages[index] = delta.usage
            chunk = delta_chunk(index, delta)
            if chunk is not None:
                yield chunk
            try:
                index, delta = await anext(stream)
            except StopAsyncIteration:
                break
        if plan.include_usage:
            usage = _usage(plan, usages)
            yield chat_chunk([], usage) if plan.chat else completion_chunk([], usage)
    except Exception as exc:  # the response has started: the error travels as an event
        log_failure(exc, started=True)
        yield event(error_body(exc)[1])
    finally:
        await stream.aclose()
    yield DONE
