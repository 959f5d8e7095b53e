"""The model executor: runs the engine loop's steps on the model (engine.executor's protocol).

It sizes the KV pool from the memory budget, starts the tensor-parallel ranks when asked, and
per step has the model runner prepare inputs and run the forward (on every rank), then samples
one token per sampling row (with the structured-output grammars' masks, computed while the
forward runs; a request's speculative drafts are verified instead: engine.spec_decode), records
the prompt logprobs the step computed and finishes the vectors of the embedding requests the
step pooled (engine.pooler). With the pooling runner it serves embedding
requests only. It never schedules, never changes what a request has computed and never decides
that a request ends (the loop does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.config import EngineConfig
from common.default_model import engine_model_path
from common.gguf_file import hold_gguf
from common.sampling_params import SamplingParams
from engine.core.kv_cache_manager import kv_groups, num_blocks_for_budget
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.decode_programs import kernel_rows
from engine.distributed import EngineGroup, start_engine_group
from engine.errors import EngineGroupError, InvalidRequestError
from engine.executor import ExecutorOutput
from engine.fallback import warn_fallback
from engine.grammar import validate_sampling_params
from engine.kv_tiers.store import KVTierStore
from engine.layers.parallel import (
    SINGLE,
    TensorParallel,
    check_tensor_parallel_size,
    kv_heads_slice,
)
from engine.lora.host import LoraHost
from engine.lora.registry import LoraBackend
from engine.model_runner import ModelRunner, resolve_dtype, resolve_kv_dtype
from engine.models.config import ModelConfig
from engine.models.gguf_metadata import file_quantization
from engine.pooler import Pooler, PoolingConfig, finish
from engine.sampler import Sampler, record_prompt_logprobs
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.drafter import DraftProposer
from engine.spec_decode.verify import Verifier
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class ModelExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.model_path: Path = engine_model_path(config)
        # A GGUF file's parsed metadata, held while the engine loads: every read of the file
        # below (config, layout, weights, the tokenizer) shares it.
        loading = hold_gguf(self.model_path)
        # An in-process engine shares its process's torch threads: what it sets (--num-threads,
        # rank 0's share of the cores) ends with it (close), or a later engine or the caller's
        # own work would run on that share.
        self._threads_before = torch.get_num_threads()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config = ModelConfig.from_dir(self.model_path)
        self.model_config = model_config
        self.structured = StructuredOutputManager(
            self.model_path,
            model_config.vocab_size,
            sorted(set(model_config.eos_token_ids)),
            config.device,
        )
        self.pooling = PoolingConfig.from_dir(self.model_path)
        # "generate" serves text and embeddings; "pooling" embeddings only.
        self.runner_kind = config.runner
        if self.runner_kind == "auto":
            self.runner_kind = "pooling" if self.pooling.sentence_transformers else "generate"
        quantization = config.quantization or file_quantization(self.model_path)
        dtype = resolve_dtype(config.dtype, config.device, quantization)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, config.device)
        tp_size = config.tensor_parallel_size
        spec = config.speculative
        if spec is not None and spec.method == "draft_model" and tp_size > 1:
            raise ValueError(
                "speculative_config: method draft_model with tensor parallelism "
                "(tensor_parallel_size > 1) is not supported yet (ngram and suffix are)"
            )
        check_tensor_parallel_size(
            model_config.num_attention_heads, model_config.num_key_value_heads, tp_size
        )
        self.kv_groups = kv_groups(model_config.layer_windows, model_config.num_hidden_layers)
        # The budget is per rank: each holds its share of the KV heads, all the same block ids;
        # a block id holds one KV group's layers.
        self.num_blocks = config.num_kv_blocks or num_blocks_for_budget(
            config.kv_cache_memory_bytes,
            self.kv_groups.num_slots,
            kv_heads_slice(model_config.num_key_value_heads, TensorParallel(0, tp_size)).count,
            model_config.head_dim,
            config.block_size,
            kv_dtype.itemsize,
        )
        self.max_model_len = self._max_model_len(
            config,
            model_config,
            self.kv_groups.tokens_held(
                self.num_blocks, config.block_size, config.max_num_batched_tokens
            ),
        )
        narrower = (
            ""
            if kv_dtype == dtype
            else f" under {str(dtype).removeprefix('torch.')} activations (--kv-cache-dtype "
            f"{config.kv_cache_dtype}: K and V rounded to it as they are written)"
        )
        logger.info(
            "KV pool: %d blocks of %d tokens in %s%s",
            self.num_blocks,
            config.block_size,
            str(kv_dtype).removeprefix("torch."),
            narrower,
        )
        self.group: EngineGroup | None = None
        self.kv_tiers: KVTierStore | None = None  # set below; close() may run before
        if tp_size > 1:
            self.group = start_engine_group(
                config, self.model_path, self.num_blocks, self.max_model_len
            )
        try:
            self.runner = ModelRunner(
                config,
                str(self.model_path),
                self.num_blocks,
                self.max_model_len,
                self.group.tp if self.group else SINGLE,
                Pooler(self.pooling.pooling_type),
            )
            self.draft_proposer: DraftProposer | None = self._draft_model(
                config, model_config.vocab_size
            )
        except BaseException:
            self.close()
            raise
        self.max_invariant_rows = kernel_rows(self.runner.model)
        if self.group is not None:
            self.runner.broadcast_plan = self.group.broadcast_plan
        self.kv_tiers = KVTierStore.create(
            config,
            self.runner.kv_slots,
            self.kv_groups,
            self.model_path,
            quantization,
            activations=self.runner.dtype,
        )
        if self.kv_tiers is not None and self.group is not None:
            # The book stays here; every rank moves its own shard of the blocks it names.
            group = self.group
            self.kv_tiers.link_ranks(
                lambda message: self._on_ranks(group.broadcast_tiers, message),
                lambda flags: self._on_ranks(group.all_min, flags),
            )
        self.kv_tier_book = self.kv_tiers.book if self.kv_tiers is not None else None
        # A block id's bytes per rank (each slot tensor: [2, num_blocks, ...]), times its groups
        # and ranks.
        self.kv_block_bytes = (
            sum(kv.nbytes // kv.shape[1] for kv in self.runner.kv_slots)
            * self.kv_groups.num_groups
            * tp_size
        )
        # LoRA adapters' host copies behind the model's slots (engine.lora.host).
        slots = self.runner.lora
        self.lora_backend: LoraBackend | None = (
            LoraHost(
                slots,
                config.max_lora_rank,
                self.runner.dtype,
                self.group.broadcast_lora if self.group is not None else None,
            )
            if slots is not None
            else None
        )
        if slots is not None and not config.enforce_eager and self.runner.device.type == "cuda":
            warn_fallback(
                logger,
                "CUDA graphs",
                "decode steps run eagerly",
                "the engine serves LoRA adapters, whose rows change per step",
            )
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.sampler = Sampler(
            model_config.vocab_size, sorted(self.eos_token_ids), config.device, config.seed
        )
        self.verifier = Verifier(self.sampler, config.seed)
        del loading  # a served engine keeps no parsed metadata (about 12 MB for the default GGUF's)

    def _draft_model(self, config: EngineConfig, vocab_size: int) -> DraftModel | None:
        """--speculative-config's draft model, on this device, with a KV pool of its own: as
        many blocks as the target's plus one a sequence (the drafts past a request's tokens)."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        return DraftModel(
            config,
            spec,
            vocab_size,
            resolve_dtype(config.dtype, config.device, spec.quantization),
            self.runner.device,
            self.num_blocks + config.max_num_seqs,
            self.max_model_len,
        )

    @staticmethod
    def _max_model_len(config: EngineConfig, model_config: ModelConfig, pool_tokens: int) -> int:
        """pool_tokens: the longest request the KV pool holds alone."""
        if config.max_model_len is not None:
            if config.max_model_len > pool_tokens:
                raise ValueError(
                    f"max_model_len ({config.max_model_len}) exceeds the KV cache capacity "
                    f"({pool_tokens} tokens in blocks of {config.block_size}); "
                    "raise kv_cache_memory_bytes / num_kv_blocks or lower max_model_len"
                )
            return config.max_model_len
        limit = min(model_config.max_position_embeddings, pool_tokens)
        if limit < model_config.max_position_embeddings:
            logger.warning(
                "max_model_len capped at %d tokens by the KV cache size (model allows %d)",
                limit,
                model_config.max_position_embeddings,
            )
        return limit

    @property
    def dtype_name(self) -> str:
        return str(self.runner.dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype_name(self) -> str:
        return str(self.runner.kv_dtype).removeprefix("torch.")

    def validate_params(self, params: SamplingParams, vocab_size: int) -> None:
        validate_sampling_params(params, vocab_size)

    def join(self, request: Request) -> None:
        if request.pooling is not None:
            self.pooling.check(request.pooling)
            return  # nothing is sampled
        if self.runner_kind == "pooling":
            raise InvalidRequestError(
                "this engine serves its model for embeddings only (runner pooling): it generates "
                "no text; send embedding requests, or serve the model with --runner generate"
            )
        if request.sampling_params.structured_output is not None:
            self.structured.add(request)
        # Its (and its samples') sampling rows are built now, not at every step it samples.
        self.sampler.join(request)

    def leave(self, request: Request) -> None:
        self.structured.release(request)
        self.sampler.leave(request)

    def execute(self, step: SchedulerOutput, started: float) -> ExecutorOutput:
        t0 = time.perf_counter()
        if self.kv_tiers is not None:
            self.kv_tiers.apply(self.kv_tiers.book.take_transfers())
        model_input = self._on_ranks(self.runner.prepare, step.plan)
        # Structured output: the grammars' masks are computed while the forward runs.
        masks = self.structured.start_masks(step.sampling_requests)
        t1 = time.perf_counter()
        forward = self._on_ranks(self.runner.forward, model_input)
        logits = forward.logits
        t2 = time.perf_counter()
        # Rows past the sampled ones are prompt positions whose logprobs were asked.
        num_sampled = model_input.num_sampled
        # A step where some request drafted tokens verifies them (engine.spec_decode.verify).
        sample = self.verifier.sample if step.plan.num_spec_tokens else self.sampler.sample
        sampled = sample(
            logits[:num_sampled],
            step.sampling_requests,
            masks.result() if masks is not None else None,
        )
        if step.plan.prompt_logprob_spans:
            record_prompt_logprobs(
                logits[num_sampled:, : self.vocab_size],
                step.plan.prompt_logprob_spans,
                step.requests,
            )
        embeddings = []
        if step.pooling_requests:
            assert forward.pooled is not None, "the runner pooled nothing for a pooling step"
            embeddings = [
                finish(vector, request.pooling.dimensions if request.pooling else None)
                for vector, request in zip(forward.pooled, step.pooling_requests, strict=True)
            ]
        t3 = time.perf_counter()
        return ExecutorOutput(sampled, t1 - t0, t2 - t1, t3 - t2, embeddings=embeddings)

    def _on_ranks(self, run, arg):
        """run(arg): a runner phase. With several ranks (the plan's broadcast, the forward's
        collectives) any failure leaves them out of step: the group is done."""
        if self.group is None:
            return run(arg)
        self.group.raise_if_failed()
        try:
            return run(arg)
        except Exception as exc:
            raise self.group.step_failed(exc) from exc

    def constraint_ended(self, request: Request) -> bool:
        return request.sampling_params.structured_output is not None and self.structured.advance(
            request
        )

    def grammar_allows(self, request: Request, tokens: list[int]) -> int:
        if request.sampling_params.structured_output is None:
            return len(tokens)
        return self.structured.allowed_prefix(request, tokens)

    def close(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.close()  # the host tier's queued saves, then its thread
        if self.group is not None:
            self.group.close()
        torch.set_num_threads(self._threads_before)

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        if self.group is not None:
            self.group.add_failure_listener(listener)
