"""Engine library outputs -> protobuf for the engine service (sampling parameters come in
through common.sampling_proto). Pure translation: never validates or computes anything."""

from __future__ import annotations

import grpc
from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2

from common.errors import status_code_for
from common.finish_reason import finish_reason_to_proto
from engine.async_engine import Event, RequestFailed
from engine.core.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from engine.core.outputs import RequestOutput


def error_output(request_id: str, error: Exception) -> engine_pb2.RequestOutput:
    code: grpc.StatusCode = status_code_for(error)
    return engine_pb2.RequestOutput(
        request_id=request_id,
        finished=True,
        error=engine_pb2.RequestError(
            code=code.value[0],
            message=str(error),
            param=getattr(error, "param", None) or "",
            retry_after_seconds=getattr(error, "retry_after", None) or 0,
        ),
    )


def event_to_proto(event: Event) -> engine_pb2.RequestOutput:
    if isinstance(event, RequestFailed):
        return error_output(event.request_id, event.error)
    return _output_to_proto(event)


def _token_logprob(
    token_id: int, logprob: float, top: list[tuple[int, float]]
) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def _output_to_proto(out: RequestOutput) -> engine_pb2.RequestOutput:
    message = engine_pb2.RequestOutput(
        request_id=out.request_id,
        index=out.index,
        token_ids=out.new_token_ids,
        logprobs=[
            _token_logprob(token_id, logprob, top)
            for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs, strict=False)
        ],
        prompt_logprobs=[_token_logprob(*record) for record in out.prompt_logprobs or ()],
        finished=out.finished,
        embedding=out.embedding,
    )
    if out.finished:
        assert out.finish_reason is not None  # a finished output says why
        message.finish_reason = finish_reason_to_proto(out.finish_reason)
        message.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
                draft_tokens=out.num_draft_tokens,
                accepted_draft_tokens=out.num_accepted_tokens,
            )
        )
        message.queue_seconds = out.queue_seconds
    return message


def _kv_event_to_proto(event: KVEvent) -> engine_pb2.KvEvent:
    if isinstance(event, BlockStored):
        return engine_pb2.KvEvent(
            block_stored=engine_pb2.BlockStored(
                block_hashes=event.block_hashes,
                parent_block_hash=event.parent_block_hash,
                token_ids=event.token_ids,
                block_size=event.block_size,
                medium=event.medium,
                lora_name=event.lora_name,
            )
        )
    if isinstance(event, BlockRemoved):
        return engine_pb2.KvEvent(
            block_removed=engine_pb2.BlockRemoved(
                block_hashes=event.block_hashes, medium=event.medium
            )
        )
    return engine_pb2.KvEvent(all_blocks_cleared=engine_pb2.AllBlocksCleared())


def kv_event_batch_to_proto(batch: KVEventBatch) -> engine_pb2.SubscribeKvEventsResponse:
    return engine_pb2.SubscribeKvEventsResponse(
        sequence_number=batch.sequence_number,
        epoch=batch.epoch,
        timestamp=batch.timestamp,
        events=[_kv_event_to_proto(e) for e in batch.events],
        snapshot=batch.snapshot,
    )
