"""The model runner's persistent batch: one row per request it holds, kept across steps.

A row holds a request's token ids and block table, in preallocated numpy arrays. Rows change
only when a step plan says so: a request joins (its whole state is written once), leaves
(finished, aborted, forked or preempted: its row is freed for the next one to join), grows
(the token and block ids appended to it) or loses the tail of its block table (blocks that only
rejected speculative drafts reached). Nothing is rebuilt per step, so a step's inputs are
a few vectorized gathers over the rows it schedules (ModelRunner.prepare).

This module knows only the plan's plain data: it never sees a Request, never decides what
runs and never touches the model or the KV cache tensors.
"""

from __future__ import annotations

import heapq

import numpy as np

from engine.core.step_plan import StepPlan


class PersistentBatch:
    def __init__(self, max_rows: int, max_model_len: int, max_blocks_per_seq: int) -> None:
        self.max_rows = max_rows
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        # Lowest free row first, so the rows in use stay packed at the top.
        self._free_rows = list(range(max_rows))

    def __len__(self) -> int:
        return len(self.row_of)

    def apply(self, plan: StepPlan) -> None:
        """Bring the rows in line with the plan: departures, then joins, then growth."""
        for seq_id in plan.finished_ids:
            self._remove(seq_id)
        for seq_id in plan.preempted_ids:
            self._remove(seq_id)
        for seq_id, num_blocks in plan.block_truncations:
            row = self.row_of.get(seq_id)  # None: it left since (preempted, finished)
            if row is not None:
                self.num_blocks[row] = num_blocks
        for new in plan.new_requests:
            if not self._free_rows:
                raise RuntimeError(
                    f"the step plan adds request {new.seq_id} to a batch whose {self.max_rows} "
                    "rows are all held"
                )
            row = heapq.heappop(self._free_rows)
            self.row_of[new.seq_id] = row
            self.num_tokens[row] = self.num_blocks[row] = 0
            self._append(row, new.token_ids, new.block_ids)
        for running in plan.running_requests:
            self._append(self.row_of[running.seq_id], running.new_token_ids, running.new_block_ids)

    def rows(self, seq_ids: list[int]) -> np.ndarray:
        row_of = self.row_of
        return np.fromiter((row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))

    def _remove(self, seq_id: int) -> None:
        heapq.heappush(self._free_rows, self.row_of.pop(seq_id))

    def _append(self, row: int, token_ids: list[int], block_ids: list[int]) -> None:
        if token_ids:
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(token_ids)] = token_ids
            self.num_tokens[row] = n + len(token_ids)
        if block_ids:
            n = int(self.num_blocks[row])
            self.block_table[row, n : n + len(block_ids)] = block_ids
            self.num_blocks[row] = n + len(block_ids)
