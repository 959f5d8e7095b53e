"""The executor: turns a step plan into flat tensors, runs the model, returns logits.

Owns the model weights and the paged KV cache tensors. Inputs are written into persistent
host buffers (numpy views over torch tensors, so no per-step allocation of the big arrays)
and, on a GPU, copied once per step into persistent device buffers; decode-only steps replay
a captured CUDA graph on a GPU and run a compiled program on the CPU, where a step that only
verifies speculative drafts runs one too (its tokens as one-token rows). Only the rows that will
be sampled, and the prompt positions of requests that asked for prompt logprobs, are
projected to logits; the hidden states of embedding requests go to the pooler (engine.pooler).
It reads only the plain-data step plan (engine.core.step_plan), never a live Request: the requests'
token ids and block tables live in its persistent batch (engine.input_batch), which the plan
updates, so a runner in another process (a tensor-parallel rank) works the same way: rank 0's
runner hands each plan to `broadcast_plan` first, the other ranks' runners receive it.
This module never decides what to run (the scheduler does) nor which token to pick (the
sampler does).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import EngineConfig
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.compiled_decode import CompiledDecode
from engine.compiled_decode import give_up as give_up_compiling
from engine.core.kv_cache_manager import kv_groups
from engine.core.step_plan import StepPlan
from engine.cuda_graphs import DecodeGraphs
from engine.input_batch import PersistentBatch
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.lora import LoraSlots
from engine.layers.parallel import SINGLE, TensorParallel
from engine.models.config import ModelConfig
from engine.models.gguf_metadata import file_quantization
from engine.models.loader import load_model
from engine.pooler import Pooler, PoolSlice
from engine.spec_decode.verify import sampled_rows, verifies_only, write_drafts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype's names beyond the activations' (common.config.KV_CACHE_DTYPES).
_KV_DTYPES = {
    **_DTYPES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_dtype(
    name: str, device: str | torch.device, quantization: str | None = None
) -> torch.dtype:
    """ "auto" is bfloat16 where the device computes it natively (Ampere/Hopper, CPUs with
    AVX-512 bf16 or AMX) and float32 elsewhere: on an AVX2-only CPU, bf16 matmuls are emulated
    and run far slower than fp32, and a bfloat16 checkpoint's weights stay bfloat16 there,
    widened to float32 in Folio's AVX2 kernel (engine.layers.linear.pack_weight; the loader logs
    which kernels the linears got). A quantized model on the CPU is float32 where Folio's integer
    kernels load: they take float32 activations (and quantize them to int8 themselves), and beat
    torch's bfloat16 weight-only kernels even on CPUs with native bf16 (docs/quantization.md).
    The CPU's side of the answer comes from its capabilities (engine.kernels.cpu.capabilities)."""
    if name != "auto":
        return _DTYPES[name]
    if torch.device(device).type == "cpu":
        capabilities = cpu_capabilities()
        if quantization is not None and capabilities.folio_kernels:
            return torch.float32
        if not capabilities.native_bf16:
            return torch.float32
    return torch.bfloat16


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """--kv-cache-dtype against the activations' `dtype`: "auto" is theirs; a narrower cache
    (bfloat16 under float32 activations, an 8-bit float under either) runs on the CPU, whose
    attention (Folio's kernels, or torch's ops) widens the cached values as it reads them; the
    Triton kernels read the cache in the activations' dtype, so a GPU takes only that."""
    if name == "auto":
        return dtype
    kv_dtype = _KV_DTYPES[name]
    if kv_dtype != dtype and torch.device(device).type != "cpu":
        instead = "" if name.startswith("fp8") else f", or dtype {name}"
        raise ValueError(
            f"kv_cache_dtype {name} under {str(dtype).removeprefix('torch.')} activations runs "
            f"on the CPU only (the GPU's attention reads the cache in the activations' dtype); "
            f"use kv_cache_dtype auto on {device}{instead}"
        )
    return kv_dtype


def kv_pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero KV cache tensor. On the CPU its memory is an anonymous mapping, which the kernel
    zeroes page by page on first touch: a pool of gigabytes costs nothing at start-up (writing
    its zeros took seconds of an engine's start), and only the blocks ever used take memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    memory = mmap.mmap(-1, numel * dtype.itemsize)  # kept alive by the tensor
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


class StepBuffer:
    """One persistent input array: a host tensor with a numpy view for cheap filling, and its
    device mirror (the same tensor when the device is the CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu = device.type != "cpu"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host

    def upload(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """The first rows (and cols) on the device; copied there when it is not the CPU."""
        src = self.host[:rows] if cols is None else self.host[:rows, :cols]
        if self.device is self.host:
            return src
        dst = self.device[:rows] if cols is None else self.device[:rows, :cols]
        return dst.copy_(src, non_blocking=True)


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Flat indices of the last token of each request that samples this step (once per sample),
    # then those of the prompt positions of the plan's prompt_logprob_spans.
    logits_indices: torch.Tensor
    # How many of the logits rows are sampled; the rest are prompt-logprob rows.
    num_sampled: int
    # Set when this step replays the CUDA graph captured for that many one-token rows (a
    # decode-only step, or one that only verifies drafts).
    graph_size: int | None = None
    # Copy-on-write (source, destination) KV blocks, copied before the forward writes.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The embedding requests' new tokens (rank 0 only), in batch order.
    pool_slices: list[PoolSlice] = field(default_factory=list)
    # A step that only verifies drafts, its tokens as one-token rows (attn_metadata's).
    verifies: bool = False


@dataclass
class ForwardOutput:
    # [rows of logits_indices, vocab] float32 (None on tensor-parallel ranks other than 0).
    logits: torch.Tensor | None
    # [embedding requests whose prompt this step completes, hidden] float32, in batch order,
    # not normalised; None when there is none.
    pooled: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        num_blocks: int,
        max_model_len: int,
        tp: TensorParallel = SINGLE,
        pooler: Pooler | None = None,
    ) -> None:
        """`pooler`: rank 0's, which pools the embedding requests (other ranks have none)."""
        self.device = torch.device(config.device)
        quantization = config.quantization or file_quantization(model_path)
        self.dtype = resolve_dtype(config.dtype, config.device, quantization)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, config.device)
        self.block_size = config.block_size
        self.model, self.model_config = load_model(
            model_path,
            self.dtype,
            self.device,
            config.attention_backend,
            dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel),
            config.quantization,
        )
        cfg: ModelConfig = self.model_config
        self.num_blocks = num_blocks
        # With tensor parallelism: rank 0 sends each plan to the other ranks through this.
        self.broadcast_plan: Callable[[StepPlan], None] | None = None
        # One cache tensor per slot of the KV groups (engine.core.kv_cache_manager): a layer's
        # is its slot's, shared with the layers of other groups in the same slot.
        self.kv_groups = groups = kv_groups(cfg.layer_windows, cfg.num_hidden_layers)
        self.kv_slots = [
            kv_pool_zeros(
                (2, num_blocks, self.block_size, self.model.num_kv_heads, cfg.head_dim),
                self.kv_dtype,
                self.device,
            )  # num_kv_heads: this rank's share
            for _ in range(groups.num_slots)
        ]
        self.kv_caches = [self.kv_slots[slot] for slot in groups.layer_slot]
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        max_seqs = config.max_num_seqs
        # Block tables hold one block id per KV group for each logical block, interleaved.
        self.max_blocks_per_seq = groups.num_groups * -(-max_model_len // self.block_size)
        dev = self.device
        self.input_ids = StepBuffer((max_tokens,), torch.int64, dev)
        self.positions = StepBuffer((max_tokens,), torch.int64, dev)
        self.slot_mapping = StepBuffer((max_tokens,), torch.int64, dev)
        # The other KV groups' slots, for a model with several.
        self.group_slot_mappings = [
            StepBuffer((max_tokens,), torch.int64, dev) for _ in range(groups.num_groups - 1)
        ]
        # Rows of a step: one a request, or one a token where a step that only verifies drafts
        # runs as one-token rows (prepare).
        spec = config.speculative
        max_rows = max_seqs
        if spec is not None:
            max_rows = min(max_tokens, max_seqs * (1 + spec.num_speculative_tokens))
        self.query_start_loc = StepBuffer((max_rows + 1,), torch.int32, dev)
        self.seq_lens = StepBuffer((max_rows,), torch.int32, dev)
        self.block_tables = StepBuffer((max_rows, self.max_blocks_per_seq), torch.int32, dev)
        # Sampled rows are at most max_seqs (samples of n > 1 requests included); prompt-logprob
        # rows make up to one per token.
        self.logits_indices = StepBuffer((max_tokens + max_seqs,), torch.int64, dev)
        self._arange = np.arange(max(max_model_len, max_tokens), dtype=np.int64)
        self.batch = PersistentBatch(max_seqs, max_model_len, self.max_blocks_per_seq)
        self.pooler = pooler
        # LoRA slots on the linears (engine.layers.lora): compiled decode programs take them
        # (their mask and weights are persistent tensors); CUDA graphs do not.
        self.lora = (
            LoraSlots(
                self.model,
                cfg,
                config.max_loras,
                config.max_lora_rank,
                max_seqs,
                max_tokens,
                self.dtype,
                dev,
            )
            if config.lora_enabled
            else None
        )
        # Neither graph capture nor compilation covers the collectives of tensor parallelism.
        # Compiled first: graph capture runs the model through run_model, which reads it.
        # Nor do they cover several KV groups' tables.
        single = tp.size == 1 and groups.num_groups == 1
        self.compiled_decode = (
            CompiledDecode.start_if_enabled(self, config, model_path) if single else None
        )
        self.graphs = (
            DecodeGraphs.capture_if_enabled(self, config) if single and self.lora is None else None
        )
        # A step that only verifies drafts runs as one-token rows (prepare) where decode steps
        # run from graphs, and on the CPU's torch backend (compiled or eagerly): each token
        # through the decode arithmetic that the same token gets without speculation. Through
        # the attention's prefill path (its products in blocks) a bfloat16 step rounded
        # otherwise, and greedy text changed with drafts.
        self.cpu_verifies_as_rows = (
            single and dev.type == "cpu" and isinstance(self.model.backend, TorchAttentionBackend)
        )

    def prepare(self, plan: StepPlan) -> ModelInput:
        """Apply the plan to the persistent batch, then write the step's flat inputs: a few
        vectorized gathers over the scheduled rows, in the plan's batch order."""
        if self.broadcast_plan is not None:
            self.broadcast_plan(plan)
        self.batch.apply(plan)
        if self.lora is not None:
            self.lora.join(plan.new_requests, self.batch.row_of)
        if self.pooler is not None:
            self.pooler.forget(plan.finished_ids)
            self.pooler.forget(plan.preempted_ids)
        bs = self.block_size
        num_reqs = plan.num_scheduled
        rows = self.batch.rows(plan.scheduled_ids)
        if plan.num_spec_tokens:
            write_drafts(self.batch, rows, plan)
        computed = np.array(plan.num_computed_tokens, dtype=np.int64)
        query_lens = plan.num_new_tokens
        num_new = np.array(query_lens, dtype=np.int64)
        ends = np.cumsum(num_new)
        num_tokens = int(ends[-1])
        starts = ends - num_new
        seq_lens = computed + num_new
        max_seq_len = int(seq_lens.max())
        num_groups = self.kv_groups.num_groups
        cols = num_groups * -(-max_seq_len // bs)

        # Per flat token: its batch entry, then its position in that request.
        entry = np.repeat(np.arange(num_reqs), num_new)
        if self.lora is not None:
            self.lora.prepare(rows[entry])
        positions = computed[entry] + (self._arange[:num_tokens] - starts[entry])
        tables = self.block_tables.np
        tables[:num_reqs, :cols] = self.batch.block_table[rows, :cols]
        self.input_ids.np[:num_tokens] = self.batch.token_ids[rows[entry], positions]
        self.positions.np[:num_tokens] = positions
        # Group 0's slots (the only group's, usually); entry i * G + g is group g's block i.
        first_entries = positions // bs * num_groups
        self.slot_mapping.np[:num_tokens] = tables[entry, first_entries] * bs + positions % bs
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = ends
        self.seq_lens.np[:num_reqs] = seq_lens

        # Logits rows: each sampled entry's last token (once per sample), then prompt positions.
        logits_idx = self.logits_indices.np
        num_logits = plan.num_sampled_rows
        logits_idx[:num_logits] = sampled_rows(ends, plan)
        for span in plan.prompt_logprob_spans:
            i = span.batch_index
            first_row = starts[i] + span.first_token - 1 - computed[i]
            logits_idx[num_logits : num_logits + span.count] = self._arange[
                first_row : first_row + span.count
            ]
            num_logits += span.count
        pool_slices = []
        if self.pooler is not None:
            num_tokens_of = self.batch.num_tokens
            for i in plan.pooled_entries:
                end = int(seq_lens[i])
                pool_slices.append(
                    PoolSlice(
                        plan.scheduled_ids[i],
                        int(starts[i]),
                        query_lens[i],
                        end - query_lens[i],
                        end == int(num_tokens_of[rows[i]]),
                    )
                )

        nd = plan.num_decodes
        verifies = (self.graphs is not None or self.cpu_verifies_as_rows) and verifies_only(plan)
        graph_size = None
        if self.graphs is not None and (nd == num_reqs or verifies):
            graph_size = self.graphs.size_for(num_tokens)
        num_rows = num_reqs
        if verifies or graph_size is not None:
            # Every token a one-token row: a decode step's, or a verification step's drafts,
            # each the decode of a context ending at itself through its entry's table (every
            # new K/V is written before any token attends). A graph reads the full-width table
            # it captured.
            if graph_size is not None:
                cols = self.max_blocks_per_seq
            tables[:num_tokens, :cols] = self.batch.block_table[rows[entry], :cols]
            self.seq_lens.np[:num_tokens] = seq_lens = positions + 1
            self.query_start_loc.np[: num_tokens + 1] = self._arange[: num_tokens + 1]
            query_lens = [1] * num_tokens
            nd = num_rows = num_tokens
            if graph_size is not None:
                self.pad_decode_rows(num_tokens, graph_size)
                num_rows = num_tokens = graph_size
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_rows + 1),
            seq_lens=self.seq_lens.upload(num_rows),
            block_tables=self.block_tables.upload(num_rows, cols),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens.tolist(),
            num_decodes=nd,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            block_size=bs,
        )
        if num_groups > 1:
            meta.layer_metas = self._group_metas(meta, entry, first_entries, positions, cols)
        return ModelInput(
            input_ids=self.input_ids.upload(num_tokens),
            positions=self.positions.upload(num_tokens),
            attn_metadata=meta,
            logits_indices=self.logits_indices.upload(num_logits),
            num_sampled=plan.num_sampled_rows,
            graph_size=graph_size,
            block_copies=plan.block_copies,
            pool_slices=pool_slices,
            verifies=verifies,
        )

    def _group_metas(
        self,
        meta: AttentionMetadata,
        entry: np.ndarray,
        first_entries: np.ndarray,
        positions: np.ndarray,
        cols: int,
    ) -> list[AttentionMetadata]:
        """Each layer's metadata: its KV group's slots and block table (group 0's are meta's
        own, its table cut out of the interleaved one)."""
        bs, num_groups = self.block_size, self.kv_groups.num_groups
        tables, num_reqs, num_tokens = self.block_tables.host, meta.num_reqs, len(positions)
        metas = []
        for g in range(num_groups):
            if g == 0:
                slot_mapping = meta.slot_mapping
            else:
                buffer = self.group_slot_mappings[g - 1]
                buffer.np[:num_tokens] = (
                    self.block_tables.np[entry, first_entries + g] * bs + positions % bs
                )
                slot_mapping = buffer.upload(num_tokens)
            table = tables[:num_reqs, g:cols:num_groups].contiguous().to(self.device)
            metas.append(dataclasses.replace(meta, slot_mapping=slot_mapping, block_tables=table))
        return [metas[g] for g in self.kv_groups.layer_group]

    def placeholder_decode(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs of a decode step of `rows` one-token requests at position 0, for graph capture
        and compilation warm-ups before any request runs. Their K/V go nowhere (slot -1) where
        the backend skips such slots (Triton); the torch backend cannot, so there they go to the
        first blocks of the pool, which no request holds yet."""
        self.pad_decode_rows(0, rows)
        if isinstance(self.model.backend, TorchAttentionBackend):
            self.slot_mapping.np[:rows] = np.arange(rows)
            self.block_tables.np[:rows, 0] = np.arange(rows) // self.block_size
        return self.graph_inputs(rows)

    def graph_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """What a decode graph of `rows` one-token rows reads: the first rows of the persistent
        buffers, on the device. Its host-side lengths are placeholders (a graph freezes them)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.upload(rows),
            query_start_loc=self.query_start_loc.upload(rows + 1),
            seq_lens=self.seq_lens.upload(rows),
            block_tables=self.block_tables.upload(rows, self.max_blocks_per_seq),
            query_lens_cpu=[1] * rows,
            seq_lens_cpu=[1] * rows,
            num_decodes=rows,
            max_query_len=1,
            max_seq_len=1,
            block_size=self.block_size,
        )
        return self.input_ids.upload(rows), self.positions.upload(rows), meta

    def pad_decode_rows(self, num_reqs: int, graph_size: int) -> None:
        """Rows num_reqs..graph_size of a graph batch: one token that writes nowhere (slot -1)
        and attends to one position of block 0; their outputs are never read."""
        pad = slice(num_reqs, graph_size)
        self.input_ids.np[pad] = 0
        self.positions.np[pad] = 0
        self.slot_mapping.np[pad] = -1
        self.seq_lens.np[pad] = 1
        self.block_tables.np[pad, 0] = 0
        self.query_start_loc.np[num_reqs + 1 : graph_size + 1] = np.arange(
            num_reqs + 1, graph_size + 1
        )

    @torch.inference_mode()
    def forward(self, model_input: ModelInput) -> ForwardOutput:
        """Logits [rows of logits_indices, vocab] in float32: one per sampling request, then
        one per prompt-logprob position (None on tensor-parallel ranks other than 0); and the
        pooled vectors of the embedding requests whose prompt ends in this step."""
        if model_input.block_copies:
            sources, dests = torch.tensor(model_input.block_copies, device=self.device).unbind(1)
            self.model.backend.copy_blocks(self.kv_slots, sources, dests)
        if model_input.graph_size is not None:
            assert self.graphs is not None, "a graph size was planned without graphs"
            hidden = self.graphs.replay(model_input.graph_size)
        else:
            hidden = self.run_model(
                model_input.input_ids,
                model_input.positions,
                model_input.attn_metadata,
                model_input.verifies,
            )
        pooled = None
        if self.pooler is not None and model_input.pool_slices:
            pooled = self.pooler.pool(hidden, model_input.pool_slices)
        logits: torch.Tensor | None
        if len(model_input.logits_indices) == 0:
            logits = hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden[model_input.logits_indices])
        return ForwardOutput(logits, pooled)

    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        verifies: bool = False,
    ) -> torch.Tensor:
        """The step's hidden states: a step of one-token rows (a decode step's, or a verification
        step's tokens as such rows: `verifies`) through a compiled program where there is one,
        else eagerly; any other step eagerly as it is."""
        if self.compiled_decode is not None and meta.num_decodes == meta.num_reqs:
            try:
                hidden = self.compiled_decode(
                    input_ids, positions, self.kv_caches, meta, verify=verifies
                )
            except Exception as error:  # an optional speed-up: see engine.fallback
                # The eager run below writes the same KV slots the failed program may have.
                self.compiled_decode = None
                give_up_compiling(error)
            else:
                if hidden is not None:  # None: no program for this batch (yet): eagerly
                    return hidden
        return self.model(input_ids, positions, self.kv_caches, meta)
