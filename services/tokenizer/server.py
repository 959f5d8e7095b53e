"""The tokenizer service: TokenizerService over gRPC, a thin adapter on common.tokenizer and
common.detokenizer.

It owns text: tokenization, chat templates, incremental detokenization with stop strings, one
sequence per DetokenizeStream or many per DetokenizeSequences (SequenceTexts keeps a stream's
live sequences by id), and hands out the tokenizer itself (GetTokenizerJson) to callers that
detokenize in their own process, as the gateway does. It translates messages and errors only; it
must never import torch or the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as pb
from common.grpc_stubs.folio.v1 import tokenizer_pb2_grpc

from common.config import TokenizerOptions
from common.default_model import resolve_model_path
from common.detokenizer import IncrementalDetokenizer, bad_token_id
from common.errors import InvalidRequestError, status_code_for
from common.generation_config import SamplingDefaults, read_sampling_defaults
from common.grpc_server import GrpcService
from common.tokenizer import Tokenizer, read_chat_template

logger = logging.getLogger(__name__)

# GetTokenizerJson's chunks: well inside the message limit (common.config.GRPC_MAX_MESSAGE_BYTES).
TOKENIZER_JSON_CHUNK_BYTES = 1 << 20


def _flag(message, name: str, default: bool) -> bool:
    """An `optional bool`: its value when set, else the library default."""
    return getattr(message, name) if message.HasField(name) else default


def _chat_messages(conversation: pb.Conversation) -> list[dict]:
    messages = []
    for m in conversation.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            message["name"] = m.name
        if m.HasField("tool_call_id"):
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _arguments(call.arguments)},
                }
                for call in m.tool_calls
            ]
        messages.append(message)
    return messages


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the parsed object (as transformers'
    examples pass them), or the text itself when it is not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _template_kwargs(conversation: pb.Conversation) -> dict[str, Any]:
    """The conversation's extra template variables (a JSON object's text, or empty)."""
    if not conversation.template_kwargs:
        return {}
    try:
        kwargs = json.loads(conversation.template_kwargs)
    except ValueError as exc:
        raise InvalidRequestError(f"template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("template_kwargs must be a JSON object")
    return kwargs


def _chat_tools(conversation: pb.Conversation) -> list[dict]:
    """The tools as OpenAI writes them, which is what chat templates read."""
    tools = []
    for tool in conversation.tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.HasField("description"):
            function["description"] = tool.description
        function["parameters"] = json.loads(tool.parameters) if tool.parameters else {}
        tools.append({"type": "function", "function": function})
    return tools


def _detokenizer(tokenizer: Tokenizer, options: pb.DetokenizeOptions) -> IncrementalDetokenizer:
    """Raises ValueError for bad options (an empty stop string)."""
    return IncrementalDetokenizer(
        tokenizer,
        skip_special_tokens=_flag(options, "skip_special_tokens", True),
        stop=list(options.stop),
        include_stop_str_in_output=options.include_stop_str_in_output,
    )


class SequenceTexts:
    """The sequences of one DetokenizeSequences stream: one incremental detokenizer per live
    sequence id, each message answered entry by entry."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._live: dict[int, IncrementalDetokenizer] = {}

    def __len__(self) -> int:
        return len(self._live)

    def handle(self, request: pb.DetokenizeSequencesRequest) -> pb.DetokenizeSequencesResponse:
        for sequence_id in request.released_sequence_ids:
            self._live.pop(sequence_id, None)
        response = pb.DetokenizeSequencesResponse(
            sequences=[self._advance(entry) for entry in request.sequences]
        )
        if request.token_text_ids:
            if (bad := bad_token_id(request.token_text_ids, self._tokenizer)) is not None:
                raise ValueError(f"token_text_ids: {bad}")
            # Special tokens keep their text here: a logprob for "<|im_end|>" must say so.
            response.token_texts.extend(
                self._tokenizer.decode([i], skip_special_tokens=False)
                for i in request.token_text_ids
            )
        return response

    def _advance(self, entry: pb.SequenceTokens) -> pb.SequenceText:
        sequence_id = entry.sequence_id
        try:
            if entry.HasField("options"):
                if sequence_id in self._live:
                    raise ValueError(f"sequence {sequence_id} is already live on this stream")
                self._live[sequence_id] = _detokenizer(self._tokenizer, entry.options)
            detokenizer = self._live.get(sequence_id)
            if detokenizer is None:
                raise ValueError(f"sequence {sequence_id} is not live: start it with options")
            if (bad := bad_token_id(entry.token_ids, self._tokenizer)) is not None:
                raise ValueError(bad)
        except ValueError as exc:
            self._live.pop(sequence_id, None)
            return pb.SequenceText(sequence_id=sequence_id, finished=True, error=str(exc))
        delta = detokenizer.advance(entry.token_ids, entry.finish)
        finished = entry.finish or delta.stop_matched is not None
        if finished:
            del self._live[sequence_id]
        return pb.SequenceText(
            sequence_id=sequence_id,
            text=delta.text,
            stop_matched=delta.stop_matched or "",
            finished=finished,
        )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, service: TokenizerService) -> None:
        self._service = service

    async def _tokenizer(self, context: grpc.aio.ServicerContext[Any, Any]) -> Tokenizer:
        await self._service.abort_unless_available(context)
        assert self._service.tokenizer is not None  # serving: warm-up loaded it
        return self._service.tokenizer

    async def _check_ids(self, ids: Sequence[int], tokenizer: Tokenizer, context) -> None:
        if (bad := bad_token_id(ids, tokenizer)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer = await self._tokenizer(context)
        kind = request.WhichOneof("input")
        try:
            if kind == "chat":
                prompt = tokenizer.apply_chat_template(
                    _chat_messages(request.chat),
                    _flag(request, "add_generation_prompt", True),
                    _chat_tools(request.chat),
                    _template_kwargs(request.chat),
                    request.continue_final_message,
                )
                # As Tokenizer.encode_chat: the template writes its own special tokens.
                ids = tokenizer.encode(prompt, add_special_tokens=False)
            elif kind == "text":
                prompt = request.text
                ids = tokenizer.encode(prompt, _flag(request, "add_special_tokens", True))
            else:
                raise InvalidRequestError("set either text or chat")
        except ValueError as exc:
            await context.abort(status_code_for(exc), str(exc))
        # Every id is in the vocabulary here (encode made them), so each has its string.
        token_strs = (
            [tokenizer.id_to_token(i) or "" for i in ids] if request.return_token_strs else []
        )
        return pb.TokenizeResponse(token_ids=ids, prompt=prompt, token_strs=token_strs)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        tokenizer = await self._tokenizer(context)
        await self._check_ids(request.token_ids, tokenizer, context)
        skip = _flag(request, "skip_special_tokens", True)
        texts = (
            [tokenizer.decode([i], skip_special_tokens=skip) for i in request.token_ids]
            if request.return_token_texts
            else []
        )
        return pb.DetokenizeResponse(
            text=tokenizer.decode(request.token_ids, skip_special_tokens=skip), token_texts=texts
        )

    async def DetokenizeStream(
        self, request_iterator: AsyncIterator[pb.DetokenizeStreamRequest], context
    ) -> AsyncIterator[pb.DetokenizeStreamResponse]:
        tokenizer = await self._tokenizer(context)
        detokenizer: IncrementalDetokenizer | None = None
        ended = False
        async for request in request_iterator:
            if detokenizer is None:
                try:
                    detokenizer = _detokenizer(tokenizer, request.options)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"options: {exc}")
            await self._check_ids(request.token_ids, tokenizer, context)
            if ended:
                yield pb.DetokenizeStreamResponse(finished=True)
                continue
            assert detokenizer is not None  # context.abort() raised otherwise
            delta = detokenizer.advance(request.token_ids, request.finish)
            ended = request.finish or delta.stop_matched is not None
            yield pb.DetokenizeStreamResponse(
                text=delta.text, stop_matched=delta.stop_matched or "", finished=ended
            )

    async def DetokenizeSequences(
        self, request_iterator: AsyncIterator[pb.DetokenizeSequencesRequest], context
    ) -> AsyncIterator[pb.DetokenizeSequencesResponse]:
        sequences = SequenceTexts(await self._tokenizer(context))
        async for request in request_iterator:
            try:
                yield sequences.handle(request)
            except ValueError as exc:  # a malformed message, not one sequence's fault
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GetTokenizerJson(
        self, request: pb.GetTokenizerJsonRequest, context
    ) -> AsyncIterator[pb.GetTokenizerJsonResponse]:
        await self._service.abort_unless_available(context)
        data = self._service.tokenizer_json
        assert data is not None  # serving: warm-up made it
        for start in range(0, len(data), TOKENIZER_JSON_CHUNK_BYTES):
            yield pb.GetTokenizerJsonResponse(
                chunk=data[start : start + TOKENIZER_JSON_CHUNK_BYTES]
            )

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        tokenizer = await self._tokenizer(context)
        named = [
            pb.SpecialToken(name=name, text=text, token_id=ids[0])
            for name, text in tokenizer.special_tokens.items()
            # A special token's text encodes to exactly its own id.
            if len(ids := tokenizer.encode(text, add_special_tokens=False)) == 1
        ]
        return pb.GetInfoResponse(
            vocab_size=tokenizer.vocab_size,
            special_tokens=named,
            special_token_ids=sorted(tokenizer.special_token_ids),
            eos_token_ids=tokenizer.eos_token_ids,
            bos_token_id=tokenizer.bos_token_id,
            max_model_len=tokenizer.max_model_len,
            has_chat_template=tokenizer.chat_template is not None,
            tool_call_format=tokenizer.tool_call_format,
            reasoning_format=tokenizer.reasoning_format,
            sampling_defaults=pb.SamplingDefaults(**self._service.sampling_defaults.given()),
        )


class TokenizerService(GrpcService):
    service_names = (pb.DESCRIPTOR.services_by_name["TokenizerService"].full_name,)

    def __init__(
        self,
        model: str | None,
        host: str,
        port: int,
        options: TokenizerOptions | None = None,
    ) -> None:
        super().__init__(host, port)
        self.model = model
        self.options = options = options or TokenizerOptions()
        # Jinja source in place of the model's template (--chat-template).
        self.chat_template = (
            read_chat_template(options.chat_template) if options.chat_template else None
        )
        self.sampling_defaults = SamplingDefaults()  # read with the tokenizer
        self.tokenizer: Tokenizer | None = None
        self.tokenizer_json: bytes | None = None  # GetTokenizerJson's answer, made once

    def add_servicers(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(TokenizerServicer(self), server)

    async def warm_up(self) -> None:
        # The default model may need converting first (once, minutes): off the event loop.
        path = await asyncio.to_thread(resolve_model_path, self.model)
        tokenizer = await asyncio.to_thread(Tokenizer.from_dir, path, self.chat_template)
        options = self.options
        self.sampling_defaults = read_sampling_defaults(
            path, options.generation_config, options.override_generation_config
        )
        if given := self.sampling_defaults.given():
            logger.info(
                "sampling defaults for requests that leave them unset (--generation-config %s): %s",
                options.generation_config,
                given,
            )
        self.tokenizer_json = await asyncio.to_thread(lambda: tokenizer.to_json().encode())
        self.tokenizer = tokenizer
