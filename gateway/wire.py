"""The gateway's protobuf edge: the engine's and the tokenizer's messages in, plain data out
(gateway/messages.py), and the messages the gateway sends them built from plain data; likewise
the calls and answers of the gateway's own gRPC text API, and the health checks.

The one gateway module that imports protobuf messages (an import-linter contract): the clients
carry what this returns, and nothing past them sees protobuf. Conversion only: it never
decides, validates or talks to a service.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2, gateway_pb2
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2
from grpc_health.v1 import health_pb2

from common.finish_reason import finish_reason_from_proto, finish_reason_to_proto
from common.generation_config import SamplingDefaults
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from common.service_level import NO_SERVICE_LEVEL, ServiceLevel
from gateway.engines.pinning import NO_PIN, Pin
from gateway.messages import (
    AskedLevel,
    ChatFormats,
    ChatPrompt,
    ChatTurn,
    EngineModel,
    EngineStats,
    KvEvent,
    KvEventBatch,
    Logprob,
    RequestError,
    StepOutput,
    TextCall,
    Tokenized,
    TokenizerInfo,
    ToolCall,
)
from gateway.pipeline.text import TextDelta, TokenLogprob

# What a Generate stream sends and receives: the clients carry these without reading them.
GenerateMessage = engine_pb2.GenerateRequest
GenerateResponse = engine_pb2.GenerateResponse
# What the engine's Generate socket sends: ready, a step's GenerateResponse, or the end.
GenerateSocketFrame = engine_pb2.GenerateSocketFrame
GenerateSocketEnd = engine_pb2.GenerateSocketEnd
# The calls and answers of folio.v1.GatewayService, as its servicer receives and sends them.
GenerateCall = gateway_pb2.GatewayServiceGenerateRequest
GenerateAnswer = gateway_pb2.GatewayServiceGenerateResponse
ChatCall = gateway_pb2.ChatRequest
ChatAnswer = gateway_pb2.ChatResponse
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


# -- the engine ---------------------------------------------------------------------------------


def engine_model(info: engine_pb2.GetModelInfoResponse) -> EngineModel:
    return EngineModel(
        model=info.model,
        model_path=info.model_path,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        generate_socket_port=info.generate_socket_port,
    )


def engine_stats(stats: engine_pb2.GetStatsResponse) -> EngineStats:
    return EngineStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_cache_usage=stats.kv_cache_usage,
        num_kv_blocks=stats.num_kv_blocks,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions,
        num_steps=stats.num_steps,
        step_seconds=dict(stats.step_seconds),
        block_size=stats.block_size,
        kv_cache_dtype=stats.kv_cache_dtype,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        prefill_token_seconds=stats.prefill_token_seconds,
        decode_step_seconds=stats.decode_step_seconds,
        spec_num_drafts=stats.spec_num_drafts,
        spec_num_draft_tokens=stats.spec_num_draft_tokens,
        spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
        kv_tier_hits=dict(stats.kv_tier_hits),
        kv_tier_usage=dict(stats.kv_tier_usage),
        kv_pinned_blocks=stats.kv_pinned_blocks,
        running_lora_adapters=list(stats.running_lora_adapters),
        waiting_lora_adapters=list(stats.waiting_lora_adapters),
        resident_lora_adapters=list(stats.resident_lora_adapters),
        max_lora=stats.max_lora,
        lora_requests=dict(stats.lora_requests),
    )


def kv_event_batch(batch: engine_pb2.SubscribeKvEventsResponse) -> KvEventBatch:
    events: list[KvEvent] = []
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            events.append(KvEvent(kind, tuple(stored.block_hashes), stored.medium or "GPU"))
        elif kind == "block_removed":
            removed = event.block_removed
            events.append(KvEvent(kind, tuple(removed.block_hashes), removed.medium or "GPU"))
        elif kind == "all_blocks_cleared":
            events.append(KvEvent(kind))
    return KvEventBatch(batch.sequence_number, batch.epoch, tuple(events))


def _logprobs(records: Iterable[common_pb2.TokenLogprob]) -> tuple[Logprob, ...]:
    return tuple(
        Logprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
        for lp in records
    )


def step_output(output: engine_pb2.RequestOutput) -> StepOutput:
    if output.HasField("error"):  # it ended in the engine: its other fields mean nothing
        error = output.error
        return StepOutput(
            output.request_id,
            output.index,
            finished=True,
            error=RequestError(
                error.code, error.message, error.param or None, error.retry_after_seconds or None
            ),
        )
    return StepOutput(
        request_id=output.request_id,
        index=output.index,
        token_ids=tuple(output.token_ids),
        logprobs=_logprobs(output.logprobs) if output.logprobs else (),
        prompt_logprobs=_logprobs(output.prompt_logprobs) if output.prompt_logprobs else (),
        finished=output.finished,
        # Unset when the engine sent none; the processor refuses a finished output without one.
        finish_reason=(
            finish_reason_from_proto(output.finish_reason)
            if output.finished and output.finish_reason
            else None
        ),
        cached_tokens=output.usage.cached_tokens,
        draft_tokens=output.usage.draft_tokens,
        accepted_draft_tokens=output.usage.accepted_draft_tokens,
        queue_seconds=output.queue_seconds,
        embedding=list(output.embedding) if output.embedding else None,
    )


def generate_socket_open(authorization: str) -> bytes:
    """The Generate socket's first frame's message."""
    return engine_pb2.GenerateSocketOpen(authorization=authorization).SerializeToString()


def generate_socket_frame(payload: bytes) -> GenerateSocketFrame:
    """One frame's message from the engine's Generate socket."""
    return engine_pb2.GenerateSocketFrame.FromString(payload)


def step_outputs(response: engine_pb2.GenerateResponse) -> list[StepOutput]:
    return [step_output(output) for output in response.outputs]


def add_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    priority: int,
    pooling: PoolingParams | None = None,
    *,
    service: ServiceLevel = NO_SERVICE_LEVEL,
    lora_name: str | None = None,
    pin: Pin = NO_PIN,
) -> GenerateMessage:
    """A new request; with `pooling`, an embedding request (its sampling params unsent); with
    `lora_name`, run with that LoRA adapter; its prompt pinned as `pin` asks."""
    request = engine_pb2.EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        priority=priority,
        lora_name=lora_name or "",
        pin_ttl_seconds=pin.ttl_seconds,
        pin_owner=pin.owner,
        pin_owner_max_bytes=pin.owner_max_bytes,
        **_service_fields(service),
    )
    if pooling is not None:
        request.pooling.CopyFrom(engine_pb2.PoolingParams(dimensions=pooling.dimensions))
    else:
        request.sampling_params.CopyFrom(sampling_params_to_proto(params))
    return engine_pb2.GenerateRequest(add=request)


def _service_fields(service: ServiceLevel) -> dict[str, Any]:
    """EngineRequest's fields for a service level (unset deadlines stay unset)."""
    fields: dict[str, Any] = {"tenant": service.tenant, "tenant_weight": service.weight}
    if service.ttft_ms is not None:
        fields["slo_ttft_ms"] = service.ttft_ms
    if service.total_ms is not None:
        fields["slo_total_ms"] = service.total_ms
    return fields


def abort_request(
    request_ids: Sequence[str], samples: Sequence[tuple[str, int]]
) -> GenerateMessage:
    return engine_pb2.GenerateRequest(
        abort=engine_pb2.AbortRequest(
            request_ids=request_ids,
            samples=[engine_pb2.SampleRef(request_id=r, index=i) for r, i in samples],
        )
    )


def model_info_request() -> engine_pb2.GetModelInfoRequest:
    return engine_pb2.GetModelInfoRequest()


def stats_request() -> engine_pb2.GetStatsRequest:
    return engine_pb2.GetStatsRequest()


def load_lora_request(name: str, path: str) -> engine_pb2.LoadLoraAdapterRequest:
    return engine_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)


def unload_lora_request(name: str) -> engine_pb2.UnloadLoraAdapterRequest:
    return engine_pb2.UnloadLoraAdapterRequest(lora_name=name)


def list_lora_request() -> engine_pb2.ListLoraAdaptersRequest:
    return engine_pb2.ListLoraAdaptersRequest()


def lora_adapters(response: engine_pb2.ListLoraAdaptersResponse) -> dict[str, bool]:
    """Adapter name -> resident in one of the engine's slots."""
    return {adapter.name: adapter.resident for adapter in response.adapters}


def kv_events_request(
    start_sequence_number: int, epoch: str
) -> engine_pb2.SubscribeKvEventsRequest:
    return engine_pb2.SubscribeKvEventsRequest(
        start_sequence_number=start_sequence_number, epoch=epoch
    )


# -- the tokenizer ------------------------------------------------------------------------------


def _chat_message(turn: ChatTurn) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=turn.role,
        content=turn.content,
        name=turn.name,
        tool_calls=[
            common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
            for c in turn.tool_calls
        ],
        tool_call_id=turn.tool_call_id,
    )


def tokenize_text_request(
    text: str, add_special_tokens: bool, return_token_strs: bool
) -> tok_pb2.TokenizeRequest:
    return tok_pb2.TokenizeRequest(
        text=text, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs
    )


def tokenize_chat_request(chat: ChatPrompt, return_token_strs: bool) -> tok_pb2.TokenizeRequest:
    return tok_pb2.TokenizeRequest(
        chat=tok_pb2.Conversation(
            messages=[_chat_message(m) for m in chat.messages],
            tools=[
                common_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters)
                for t in chat.tools
            ],
            template_kwargs=json.dumps(chat.template_kwargs) if chat.template_kwargs else "",
        ),
        add_generation_prompt=chat.add_generation_prompt,
        return_token_strs=return_token_strs,
        continue_final_message=chat.continue_final_message,
    )


def tokenized(response: tok_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(list(response.token_ids), response.prompt, list(response.token_strs))


def detokenize_request(
    token_ids: Sequence[int], skip_special_tokens: bool
) -> tok_pb2.DetokenizeRequest:
    return tok_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)


def detokenized(response: tok_pb2.DetokenizeResponse) -> str:
    return response.text


def info_request() -> tok_pb2.GetInfoRequest:
    return tok_pb2.GetInfoRequest()


def tokenizer_info(info: tok_pb2.GetInfoResponse) -> TokenizerInfo:
    # The message's fields are SamplingDefaults' own; only those set are listed.
    defaults = {field.name: value for field, value in info.sampling_defaults.ListFields()}
    return TokenizerInfo(
        ChatFormats(tool_call=info.tool_call_format, reasoning=info.reasoning_format),
        SamplingDefaults(**defaults),
    )


def tokenizer_json_request() -> tok_pb2.GetTokenizerJsonRequest:
    return tok_pb2.GetTokenizerJsonRequest()


def tokenizer_json(chunks: Iterable[tok_pb2.GetTokenizerJsonResponse]) -> str:
    """The tokenizer's JSON text from GetTokenizerJson's chunks, in order."""
    return b"".join(response.chunk for response in chunks).decode()


# -- health -------------------------------------------------------------------------------------


def health_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service="")


def serving(response: health_pb2.HealthCheckResponse) -> bool:
    return response.status == health_pb2.HealthCheckResponse.SERVING


# -- the gateway's own gRPC text API ------------------------------------------------------------


def _chat_turn(message: common_pb2.ChatMessage) -> ChatTurn:
    return ChatTurn(
        role=message.role,
        content=message.content,
        name=message.name if message.HasField("name") else None,
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in message.tool_calls),
        tool_call_id=message.tool_call_id if message.HasField("tool_call_id") else None,
    )


def text_call(call: GenerateCall | ChatCall) -> TextCall:
    """A Generate or Chat call as plain data; InvalidParameter for sampling parameters out of
    range."""
    return TextCall(
        model=call.model,
        params=sampling_params_from_proto(call.sampling_params),
        stop=list(call.stop),
        include_stop_str_in_output=call.include_stop_str_in_output,
        priority=call.priority,
        prompt=call.prompt if isinstance(call, GenerateCall) else "",
        messages=tuple(_chat_turn(m) for m in call.messages) if isinstance(call, ChatCall) else (),
        asked=_asked_level(call.service_level),
    )


def _asked_level(level: gateway_pb2.ServiceLevel) -> AskedLevel:
    return AskedLevel(
        ttft_ms=level.slo_ttft_ms if level.HasField("slo_ttft_ms") else None,
        total_ms=level.slo_total_ms if level.HasField("slo_total_ms") else None,
        tenant=level.tenant or None,
        batch=level.priority_class == gateway_pb2.PRIORITY_CLASS_BATCH,
    )


def _text_logprob(lp: TokenLogprob) -> gateway_pb2.TextLogprob:
    message = gateway_pb2.TextLogprob(
        token=lp.token,
        token_id=lp.token_id,
        top_logprobs=[
            gateway_pb2.TextTopLogprob(token=text, token_id=token_id, logprob=value)
            for token_id, text, value in lp.top
        ],
    )
    if lp.logprob is not None:  # a prompt's first token has none: the field stays unset
        message.logprob = lp.logprob
    return message


class _AnswerFields(TypedDict, total=False):
    """The fields GatewayServiceGenerateResponse and ChatResponse share."""

    text: str
    logprobs: list[gateway_pb2.TextLogprob]
    finish_reason: common_pb2.FinishReason.ValueType
    usage: common_pb2.Usage


def _answer_fields(delta: TextDelta) -> _AnswerFields:
    """The answer fields of one delta."""
    fields = _AnswerFields(text=delta.text, logprobs=[_text_logprob(lp) for lp in delta.logprobs])
    if delta.usage is not None:
        # A sequence's last delta carries both its usage and its finish reason.
        if delta.finish_reason is None:
            raise ValueError("a delta with usage must have a finish reason")
        fields["finish_reason"] = finish_reason_to_proto(delta.finish_reason)
        fields["usage"] = common_pb2.Usage(
            prompt_tokens=delta.usage.prompt_tokens,
            completion_tokens=delta.usage.completion_tokens,
            cached_tokens=delta.usage.cached_tokens,
        )
    return fields


def generate_answer(delta: TextDelta) -> GenerateAnswer:
    return GenerateAnswer(**_answer_fields(delta))


def chat_answer(delta: TextDelta) -> ChatAnswer:
    return ChatAnswer(**_answer_fields(delta))
