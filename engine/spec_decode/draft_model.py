"""The draft_model proposer: a smaller model with the target's vocabulary drafts greedily.

It runs on the target's device through Folio's own model code (engine.models): its decode
steps through compiled programs of its own on the CPU, as the target's (engine.compiled_decode),
every other forward eagerly. It has a paged KV cache of its own: its own block pool, each
drafting request its own blocks and the token ids whose K/V they hold. Each step, for the
requests that draft (engine.spec_decode.drafter chose them and their lengths), the draft model
first catches up on the tokens it has not computed (the prompt on a request's first draft;
afterwards the tokens the target accepted since, usually one or two), in batched forwards of at
most `max_batch_tokens` tokens (a long prompt in chunks), then runs greedy decode steps batched
across requests, one token a request each, until each has its length. The K/V of the drafts it
computed stay where they are: when the target accepts them they are the request's next tokens
and need no recomputing; when it rejects them, what the draft model holds is cut back to the
longest prefix the request's tokens share with it, and the next tokens are written over them.

A request's blocks go back to the pool when it ends, is aborted (`release`) or is no longer
running (`retain`: preempted ones). A request whose blocks the pool cannot hold drafts nothing
that step (its blocks freed, so other requests can draft); one longer than the draft model's
positions never drafts.

It never sees the target's KV cache or logits, never schedules, and never changes a request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.config import EngineConfig
from common.speculative import SpeculativeConfig
from engine.attention.metadata import AttentionMetadata
from engine.compiled_decode import CompiledDecode
from engine.compiled_decode import give_up as give_up_compiling
from engine.core.kv_cache_manager import NULL_BLOCK, kv_groups
from engine.core.request import Request
from engine.layers.lora import LoraSlots
from engine.layers.parallel import SINGLE
from engine.model_runner import kv_pool_zeros, resolve_kv_dtype
from engine.models.config import ModelConfig
from engine.models.loader import load_model

logger = logging.getLogger(__name__)


@dataclass
class _Drafting:
    """What the draft model holds of one request: K/V of `tokens` (positions 0..) in `blocks`;
    its first `confirmed` tokens are the request's own (the rest drafts, maybe rejected)."""

    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    confirmed: int = 0


@dataclass
class _Row:
    """One request in one draft forward: its new tokens from `start` on."""

    state: _Drafting
    token_ids: list[int]
    start: int


class DraftModel:
    """The draft model, its KV pool and each drafting request's share of it."""

    def __init__(
        self,
        config: EngineConfig,
        spec: SpeculativeConfig,
        target_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        """`num_blocks`: the draft pool's size (block NULL_BLOCK never handed out). The target's
        `config` gives the attention backend, block size, the most tokens of one catch-up
        forward (max_num_batched_tokens) and whether and how decode steps compile."""
        assert spec.model is not None, "a draft_model config without its model"
        path = Path(spec.model)
        try:
            model_config = ModelConfig.from_dir(path)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"speculative_config: model: cannot read the draft model at {spec.model!r}: {exc}"
            ) from exc
        if model_config.vocab_size != target_vocab_size:
            raise ValueError(
                "speculative_config: model: the draft model's vocabulary "
                f"({model_config.vocab_size} tokens, {spec.model!r}) is not the target model's "
                f"({target_vocab_size} tokens); "
                "a draft model must share the target's vocabulary"
            )
        groups = kv_groups(model_config.layer_windows, model_config.num_hidden_layers)
        if groups.num_groups > 1:
            raise ValueError(
                f"speculative_config: model: the draft model at {spec.model!r} has sliding-window "
                "layers, which a draft model does not support yet"
            )
        self.model, _ = load_model(
            path, dtype, device, config.attention_backend, SINGLE, spec.quantization
        )
        self.vocab_size = target_vocab_size
        self.device = device
        self.dtype = dtype
        self.lora: LoraSlots | None = None  # the draft model serves no adapters
        block_size = config.block_size
        self.block_size = block_size
        self.max_batch_tokens = max(1, config.max_num_batched_tokens)
        # Positions the draft model has: a request past them drafts nothing.
        self.max_len = min(max_model_len, model_config.max_position_embeddings)
        # One cache tensor per layer (one KV group): [2, blocks, block_size, kv heads, head dim].
        caches = [
            kv_pool_zeros(
                (2, num_blocks, block_size, self.model.num_kv_heads, model_config.head_dim),
                resolve_kv_dtype(config.kv_cache_dtype, dtype, device),
                device,
            )
            for _ in range(groups.num_slots)
        ]
        self.kv_caches = [caches[slot] for slot in groups.layer_slot]
        self.num_blocks = num_blocks
        self._free = [b for b in range(num_blocks - 1, -1, -1) if b != NULL_BLOCK]
        self._requests: dict[str, _Drafting] = {}
        # Programs for its decode steps (one token a request), keyed by its own path and
        # quantization; None where the target's would be none too (a GPU, --enforce-eager).
        own = dataclasses.replace(config, quantization=spec.quantization, speculative_config=None)
        self.compiled_decode = CompiledDecode.start_if_enabled(self, own, path)
        # Their inputs, as the target's: views of persistent buffers (a program for one row
        # refuses a tensor that is its storage's whole).
        rows = max(2, config.max_num_seqs)
        self._decode_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self._decode_positions = torch.zeros(rows, dtype=torch.int64, device=device)
        logger.info(
            "draft model %s: %d layers, %d KV blocks of its own", path, len(caches), num_blocks
        )

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def holding(self) -> set[str]:
        """The requests it holds blocks for."""
        return set(self._requests)

    def release(self, request_id: str) -> None:
        """A request that ended (or was aborted): its blocks go back to the pool."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._free += state.blocks

    def retain(self, request_ids: set[str]) -> None:
        """Only these requests run: the others' (preempted ones') blocks go back."""
        for request_id in [r for r in self._requests if r not in request_ids]:
            self.release(request_id)

    # Not inference mode: the compiled programs' guards take tensors made outside it (as the
    # target's persistent input buffers are); the forwards enter it themselves.
    @torch.no_grad()
    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to lengths[i] greedy draft tokens continuing requests[i]'s tokens."""
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[tuple[int, _Row, int]] = []  # (index in requests, its row, its length)
        for i, (request, k) in enumerate(zip(requests, lengths, strict=True)):
            k = min(k, self.max_len - request.num_tokens)
            if k <= 0:
                continue
            row = self._catch_up_row(request, k)
            if row is not None:
                rows.append((i, row, k))
        if not rows:
            return drafts
        # The catch-up forwards: each row's last token's logits give its first draft.
        firsts = self._prefill([row for _, row, _ in rows])
        for (i, _, _), token in zip(rows, firsts, strict=True):
            drafts[i].append(token)
        # Then greedy decode steps, the rows still short of their length in each.
        step = 1
        active = [(i, row) for i, row, k in rows if k > 1]
        while active:
            decoded = self._decode([(row.state, drafts[i][-1]) for i, row in active])
            for (i, _), token in zip(active, decoded, strict=True):
                drafts[i].append(token)
            step += 1
            active = [(i, row) for i, row, k in rows if k > step]
        return drafts

    def _catch_up_row(self, request: Request, k: int) -> _Row | None:
        """The request's tokens the draft model has not computed (at least its last, whose
        logits give the first draft), with room in its blocks for those and k - 1 drafts; None
        when the pool cannot hold them (its blocks freed: it drafts nothing this step)."""
        token_ids = request.token_ids
        state = self._requests.setdefault(request.request_id, _Drafting())
        # The tokens held beyond `confirmed` are drafts: keep those the request accepted.
        held = state.confirmed
        limit = min(len(state.tokens), len(token_ids) - 1)
        while held < limit and state.tokens[held] == token_ids[held]:
            held += 1
        held = min(held, len(token_ids) - 1)
        del state.tokens[held:]
        state.confirmed = len(token_ids)  # once this step's catch-up has run
        # The catch-up writes up to the last token, the decode steps k - 1 drafts after it.
        needed = -(-(len(token_ids) + k - 1) // self.block_size)
        missing = needed - len(state.blocks)
        if missing > len(self._free):
            self.release(request.request_id)
            return None
        for _ in range(missing):
            state.blocks.append(self._free.pop())
        return _Row(state, list(token_ids[held:]), held)

    def _prefill(self, rows: list[_Row]) -> list[int]:
        """Compute every row's new tokens, in forwards of at most max_batch_tokens tokens (a
        long row in chunks); the greedy token after each row's last token."""
        tokens = [-1] * len(rows)
        done = [0] * len(rows)  # tokens of each row computed so far
        while True:
            budget = self.max_batch_tokens
            batch: list[tuple[int, int]] = []  # (row, tokens this forward)
            for r, row in enumerate(rows):
                left = len(row.token_ids) - done[r]
                if left and budget:
                    take = min(left, budget)
                    batch.append((r, take))
                    budget -= take
            if not batch:
                return tokens
            # Decodes first: the attention backends read the one-token rows as decodes.
            batch.sort(key=lambda entry: entry[1] != 1)
            parts = []
            for r, take in batch:
                row = rows[r]
                new = row.token_ids[done[r] : done[r] + take]
                parts.append((row.state, new))
                done[r] += take
            greedy = self._forward(parts)
            for (r, _), token in zip(batch, greedy, strict=True):
                if done[r] == len(rows[r].token_ids):
                    tokens[r] = token

    def _decode(self, entries: list[tuple[_Drafting, int]]) -> list[int]:
        """One greedy decode step: each state's newest draft in, the next draft out."""
        return self._forward([(state, [token]) for state, token in entries])

    def _forward(self, parts: list[tuple[_Drafting, list[int]]]) -> list[int]:
        """One forward of each state's new tokens after what it holds (their K/V written to
        its blocks, the tokens appended to it); the greedy token after each part's last."""
        bs = self.block_size
        query_lens = [len(new) for _, new in parts]
        seq_lens = [len(state.tokens) + len(new) for state, new in parts]
        width = max(len(state.blocks) for state, _ in parts)
        tables = np.full((len(parts), width), NULL_BLOCK, dtype=np.int32)
        positions = np.concatenate(
            [
                np.arange(len(state.tokens), end)
                for (state, _), end in zip(parts, seq_lens, strict=True)
            ]
        )
        slots = np.empty(len(positions), dtype=np.int64)
        at = 0
        for i, (state, new) in enumerate(parts):
            blocks = np.asarray(state.blocks, dtype=np.int64)
            tables[i, : len(blocks)] = blocks
            pos = positions[at : at + len(new)]
            slots[at : at + len(new)] = blocks[pos // bs] * bs + pos % bs
            at += len(new)
            state.tokens += new
        ends = np.cumsum(query_lens)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)).to(
                device
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.from_numpy(tables).to(device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            # The one-token rows come first (_prefill sorts them there; _decode has only those).
            num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(parts)),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        input_ids = torch.tensor(
            [t for _, new in parts for t in new], dtype=torch.int64, device=device
        )
        hidden = self._run(input_ids, torch.from_numpy(positions).to(device), meta)
        last = torch.from_numpy(ends - 1).to(device)
        logits = self.model.compute_logits(hidden[last])
        assert logits is not None, "a single-rank model gave no logits"
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()

    def _run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The forward's hidden states: a decode step through a compiled program where there is
        one (None: not yet, or not for this batch size), any other forward eagerly."""
        rows = len(input_ids)
        compiled = self.compiled_decode
        if compiled is not None and meta.num_decodes == meta.num_reqs <= len(self._decode_ids):
            try:
                hidden = compiled(
                    self._decode_ids[:rows].copy_(input_ids),
                    self._decode_positions[:rows].copy_(positions),
                    self.kv_caches,
                    meta,
                )
            except Exception as error:  # an optional speed-up: see engine.fallback
                # The eager run below writes the same KV slots the failed program may have.
                self.compiled_decode = None
                give_up_compiling(error)
            else:
                if hidden is not None:
                    return hidden
        return self.model(input_ids, positions, self.kv_caches, meta)
