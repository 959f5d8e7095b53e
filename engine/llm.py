"""The offline Python API: `LLM(...).generate(prompts, params)` (and `.embed(prompts)`) over the
engine loop.

Text in and out through the tokenizer library; the engine itself only sees token ids.
Drives the engine synchronously in the caller's thread; never starts servers or threads.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from common.config import EngineConfig
from common.detokenizer import IncrementalDetokenizer
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.core.outputs import RequestOutput
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError

PromptInput = str | Sequence[int]


@dataclass
class CompletionOutput:
    """The whole result for one prompt, or for one of its samples when SamplingParams.n > 1."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # Per output token: (chosen token logprob, top alternatives), when logprobs were asked.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # When prompt_logprobs were asked: one record per prompt token, None for the first (nothing
    # precedes it).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    num_cached_tokens: int = 0
    # Speculative decoding: tokens drafted for it, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class StreamDelta:
    """What one result (as generate orders them) gained in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_args))
        self.tokenizer = Tokenizer.from_dir(self.engine.model_path)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker ranks, if any; the LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; results in prompt order, n per prompt (its samples
        in order) when SamplingParams.n > 1. `lora`: the LoRA adapter (a --lora-modules name)
        every prompt, or each prompt, runs with; None: the base model."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = self._encode_all(prompt_list)
        param_list = _as_param_list(params, len(prompt_list))
        results = [
            CompletionOutput(prompt=p if isinstance(p, str) else None, prompt_token_ids=ids)
            for p, ids, sp in zip(prompt_list, token_lists, param_list, strict=False)
            for _ in range(sp.n)
        ]
        for index, out in self._run(token_lists, param_list, lora=lora):
            result = results[index]
            result.token_ids.extend(out.new_token_ids)
            result.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = [None] + [(lp, top) for _, lp, top in out.prompt_logprobs]
            result.num_cached_tokens = out.num_cached_tokens
            result.num_draft_tokens = out.num_draft_tokens
            result.num_accepted_tokens = out.num_accepted_tokens
            if out.finish_reason is not None:  # set on the last output
                result.finish_reason = out.finish_reason.value
        for result in results:
            result.text = self.tokenizer.decode(result.token_ids)
        return results

    def generate_stream(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield text deltas as the engine produces tokens, across all prompts."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = self._encode_all(prompt_list)
        param_list = _as_param_list(params, len(prompt_list))
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer) for p in param_list for _ in range(p.n)
        ]
        for index, out in self._run(token_lists, param_list):
            delta = detokenizers[index].push(out.new_token_ids)
            text = delta.text
            if out.finished:
                text += detokenizers[index].finish().text
            yield StreamDelta(
                index=index,
                text=text,
                token_ids=list(out.new_token_ids),
                finished=out.finished,
                finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
            )

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[CompletionOutput]:
        """Generate replies to one conversation or a list of them, through the chat template;
        with continue_final_message (and add_generation_prompt false) each reply continues its
        conversation's final message instead."""
        conversations = cast(
            list[list[dict]],
            [messages] if messages and isinstance(messages[0], dict) else list(messages),
        )
        prompts = [
            self.tokenizer.encode_chat(
                c,
                add_generation_prompt,
                template_kwargs=chat_template_kwargs,
                continue_final_message=continue_final_message,
            )
            for c in conversations
        ]
        return self.generate(prompts, params)

    def embed(
        self, prompts: PromptInput | Sequence[PromptInput], dimensions: int | None = None
    ) -> list[list[float]]:
        """Each prompt's embedding, in prompt order: its hidden states pooled the model's way
        (engine/pooler.py), unit length; `dimensions` cuts a Matryoshka model's vectors."""
        token_lists = self._encode_all(_as_prompt_list(prompts))
        vectors: list[list[float]] = [[] for _ in token_lists]
        params = [SamplingParams()] * len(token_lists)
        for index, out in self._run(token_lists, params, PoolingParams(dimensions)):
            if out.embedding is not None:
                vectors[index] = out.embedding
        return vectors

    def _encode_all(self, prompts: list[PromptInput]) -> list[list[int]]:
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _run(
        self,
        token_lists: list[list[int]],
        param_list: list[SamplingParams],
        pooling: PoolingParams | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Feed requests (embedding requests with `pooling`) as the waiting queue allows and
        yield (result index, RequestOutput): sample i of prompt p is result i after the n
        results of the prompts before p."""
        for p in param_list:
            self.engine.executor.validate_params(p, self.engine.vocab_size)
        loras = [lora] * len(token_lists) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(token_lists):
            raise InvalidRequestError(
                f"got {len(loras)} LoRA names for {len(token_lists)} prompts; pass one or one per "
                "prompt",
                "lora",
            )
        firsts = list(itertools.accumulate((p.n for p in param_list), initial=0))
        pending = deque(range(len(token_lists)))
        index_of: dict[str, int] = {}
        capacity = self.engine.config.max_waiting_requests
        try:
            while pending or index_of:
                while pending and len(self.engine.scheduler.waiting) < capacity:
                    index = pending.popleft()
                    request_id = f"offline-{next(self._ids)}"
                    self.engine.add_request(
                        request_id,
                        token_lists[index],
                        param_list[index],
                        pooling=pooling,
                        lora_name=loras[index],
                    )
                    index_of[request_id] = index
                outputs = self.engine.step()
                for out in outputs:
                    yield firsts[index_of[out.request_id]] + out.index, out
                for out in outputs:
                    if out.finished and out.request_id not in self.engine.requests:
                        index_of.pop(out.request_id, None)  # its last sample ended
        finally:
            for request_id in index_of:
                self.engine.abort(request_id)


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    return prompts


def _as_param_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(
            f"got {len(params)} SamplingParams for {count} prompts; pass one or one per prompt"
        )
    return params
