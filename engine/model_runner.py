"""The executor: turns a scheduled step into flat tensors, runs the model, returns logits.

Owns the model weights and the paged KV cache tensors. Inputs are written into persistent
host buffers (numpy views over torch tensors, so no per-step allocation of the big arrays);
only the rows that will be sampled are projected to logits. This module never decides what
to run (the scheduler does) nor which token to pick (the sampler does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.config import EngineConfig
from engine.attention.metadata import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.request import Request
from engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    # bf16 matmul is ~5x fp32 on AVX-512-bf16 CPUs and native on Ampere/Hopper.
    return torch.bfloat16 if name == "auto" else _DTYPES[name]


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Flat indices of the last token of each request that samples this step.
    logits_indices: torch.Tensor
    # Requests (in batch order) whose row in the logits belongs to them.
    sampling_requests: list[Request]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, num_blocks: int, max_model_len: int) -> None:
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.block_size = config.block_size
        self.model, self.model_config = load_model(
            model_path, self.dtype, self.device, attention_backend=config.attention_backend
        )
        cfg: ModelConfig = self.model_config
        self.num_blocks = num_blocks
        self.kv_caches = [
            torch.zeros(
                2, num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                dtype=self.dtype, device=self.device,
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        max_tokens = config.max_num_batched_tokens
        max_seqs = config.max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self._input_ids = torch.zeros(max_tokens, dtype=torch.int64)
        self._positions = torch.zeros(max_tokens, dtype=torch.int64)
        self._slot_mapping = torch.zeros(max_tokens, dtype=torch.int64)
        self._query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32)
        self._seq_lens = torch.zeros(max_seqs, dtype=torch.int32)
        self._block_tables = torch.zeros(max_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self._logits_indices = torch.zeros(max_seqs, dtype=torch.int64)
        # numpy views share memory with the tensors above: filling them fills the tensors.
        self._input_ids_np = self._input_ids.numpy()
        self._positions_np = self._positions.numpy()
        self._slot_mapping_np = self._slot_mapping.numpy()
        self._query_start_loc_np = self._query_start_loc.numpy()
        self._seq_lens_np = self._seq_lens.numpy()
        self._block_tables_np = self._block_tables.numpy()
        self._logits_indices_np = self._logits_indices.numpy()
        self._arange = np.arange(max_model_len, dtype=np.int64)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        num_reqs = len(sched.requests)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sampling_requests: list[Request] = []
        num_logits = 0
        offset = 0
        qsl = self._query_start_loc_np
        qsl[0] = 0
        # Decodes sorted by context length let the attention backend group them with little padding.
        nd = sched.num_decodes
        order = sorted(range(nd), key=lambda i: sched.requests[i].num_computed_tokens)
        order.extend(range(nd, num_reqs))
        for i, j in enumerate(order):
            request, num_new = sched.requests[j], sched.num_new_tokens[j]
            start = request.num_computed_tokens
            end = start + num_new
            table = request.block_table
            self._input_ids_np[offset:offset + num_new] = request.token_ids[start:end]
            positions = self._arange[start:end]
            self._positions_np[offset:offset + num_new] = positions
            self._block_tables_np[i, : len(table)] = table
            row = self._block_tables_np[i]
            self._slot_mapping_np[offset:offset + num_new] = row[positions // bs] * bs + positions % bs
            offset += num_new
            qsl[i + 1] = offset
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                self._logits_indices_np[num_logits] = offset - 1
                num_logits += 1
                sampling_requests.append(request)
        self._seq_lens_np[:num_reqs] = seq_lens
        max_seq_len = max(seq_lens)
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping[:offset],
            query_start_loc=self._query_start_loc[: num_reqs + 1],
            seq_lens=self._seq_lens[:num_reqs],
            block_tables=self._block_tables[:num_reqs, : (max_seq_len + bs - 1) // bs],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            num_decodes=sched.num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
            block_size=bs,
        )
        return ModelInput(
            input_ids=self._input_ids[:offset],
            positions=self._positions[:offset],
            attn_metadata=meta,
            logits_indices=self._logits_indices[:num_logits],
            sampling_requests=sampling_requests,
        )

    @torch.inference_mode()
    def forward(self, model_input: ModelInput) -> torch.Tensor:
        """Logits [num_sampling_requests, vocab] in float32."""
        hidden = self.model(
            model_input.input_ids.to(self.device, non_blocking=True),
            model_input.positions.to(self.device, non_blocking=True),
            self.kv_caches,
            model_input.attn_metadata,
        )
        if not model_input.sampling_requests:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[model_input.logits_indices.to(self.device)])
