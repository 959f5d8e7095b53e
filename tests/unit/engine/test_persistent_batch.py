"""The model runner consumes only the step plan and keeps a persistent batch: rows join, leave
and grow as plans say; on a tiny float32 model under chunked prefill, prefix-cache hits,
preemption, n > 1 forks, prompt logprobs and aborts, the inputs it builds from the plans equal
those built directly from the live requests, and a runner fed each plan after a round trip
through its int64 encoding (what a worker rank receives) gives the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.core.step_plan import NewRequestPlan, RunningRequestPlan, StepPlan, decode, encode
from engine.engine import LLMEngine
from engine.input_batch import PersistentBatch
from engine.model_runner import ModelInput
from tiny_models import VARIANTS, make_checkpoint

BLOCK = 4


def held(batch: PersistentBatch, seq_id: int) -> tuple[list[int], list[int]]:
    row = batch.row_of[seq_id]
    tokens = batch.token_ids[row, : batch.num_tokens[row]].tolist()
    return tokens, batch.block_table[row, : batch.num_blocks[row]].tolist()


def test_rows_join_grow_leave_and_are_reused_lowest_first():
    batch = PersistentBatch(max_rows=3, max_model_len=16, max_blocks_per_seq=4)
    batch.apply(
        StepPlan(
            new_requests=[
                NewRequestPlan(10, [1, 2, 3], [7], 0),
                NewRequestPlan(11, [4, 5], [8], 0),
                NewRequestPlan(12, [6], [9], 0),
            ]
        )
    )
    assert batch.row_of == {10: 0, 11: 1, 12: 2}
    batch.apply(StepPlan(running_requests=[RunningRequestPlan(11, [40], [80, 81])]))
    assert held(batch, 11) == ([4, 5, 40], [8, 80, 81])
    assert held(batch, 10) == ([1, 2, 3], [7])

    # 10 finishes and 12 is preempted; 12 comes back in the same plan (the priority policy can
    # preempt and readmit one request in a step): departures go first, so its row is rewritten.
    batch.apply(
        StepPlan(
            finished_ids=[10],
            preempted_ids=[12],
            new_requests=[NewRequestPlan(12, [6, 60, 61], [3, 4], 2)],
        )
    )
    assert batch.row_of == {11: 1, 12: 0} and len(batch) == 2
    assert held(batch, 12) == ([6, 60, 61], [3, 4])
    batch.apply(StepPlan(new_requests=[NewRequestPlan(13, [5], [5], 0)]))
    assert batch.row_of[13] == 2
    assert batch.rows([13, 11, 12]).tolist() == [2, 1, 0]
    with pytest.raises(RuntimeError, match="3 rows"):
        batch.apply(StepPlan(new_requests=[NewRequestPlan(14, [1], [1], 0)]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-persistent-batch")
    make_checkpoint(directory, *VARIANTS["llama"])
    return directory


def make_engine(directory) -> LLMEngine:
    # A small pool and budget: prompts are chunked and requests get preempted.
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=40,
            max_num_batched_tokens=24,
            max_num_seqs=6,
            enable_prefix_caching=True,
        )
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = prompt(16, 0)
WORKLOAD = [
    # (step it arrives at, request id, prompt, params)
    (0, "a", prompt(30, 1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    (0, "b", [*SHARED, *prompt(5, 2)], SamplingParams(temperature=0.0, max_tokens=14)),
    (1, "n3", prompt(22, 3), SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12)),
    (2, "plp", prompt(27, 4), SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2)),
    (3, "c", [*SHARED, *prompt(9, 5)], SamplingParams(temperature=0.7, seed=9, max_tokens=16)),
    (6, "gone", prompt(13, 6), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    (9, "d", prompt(40, 7), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
]
ABORTED = "gone"  # aborted while it runs, once it has produced two tokens


def reference_inputs(sched: SchedulerOutput, block_size: int) -> dict[str, list]:
    """The step's flat inputs built straight from the live requests (the path before plans)."""
    ids, positions, slots, seq_lens, tables, logits_rows, prompt_rows = [], [], [], [], [], [], []
    query_start = [0]
    for request, num_new in zip(sched.requests, sched.num_new_tokens, strict=True):
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        ids += request.token_ids[start:end]
        positions += range(start, end)
        slots += [request.block_table[p // block_size] * block_size + p % block_size
                  for p in range(start, end)]  # fmt: skip
        if request.needs_prompt_logprobs:
            first = max(start + 1, len(request.prompt_logprobs) + 1)
            last = min(end, request.num_prompt_tokens - 1)
            prompt_rows += [query_start[-1] + t - 1 - start for t in range(first, last + 1)]
        query_start.append(query_start[-1] + num_new)
        seq_lens.append(end)
        tables.append(request.block_table[: -(-end // block_size)])
        if end == request.num_tokens:
            logits_rows += [query_start[-1] - 1] * request.num_seqs
    return dict(
        ids=ids,
        positions=positions,
        slots=slots,
        query_start=query_start,
        seq_lens=seq_lens,
        tables=tables,
        logits=logits_rows + prompt_rows,
    )


def assert_inputs_match(model_input: ModelInput, expected: dict[str, list]) -> None:
    meta = model_input.attn_metadata
    assert model_input.input_ids.tolist() == expected["ids"]
    assert model_input.positions.tolist() == expected["positions"]
    assert meta.slot_mapping.tolist() == expected["slots"]
    assert meta.query_start_loc.tolist() == expected["query_start"]
    assert meta.seq_lens.tolist() == expected["seq_lens"] == meta.seq_lens_cpu
    for row, table in zip(meta.block_tables.tolist(), expected["tables"], strict=True):
        assert row[: len(table)] == table
    assert model_input.logits_indices.tolist() == expected["logits"]


def run_workload(engine: LLMEngine, through_encoding: bool) -> tuple[dict, dict]:
    """Serve WORKLOAD; every step's runner inputs are checked against the live requests. With
    through_encoding the runner gets each plan decoded from its int64 encoding, as a worker rank
    would. Returns the tokens per (request id, sample index) and counts of what happened."""
    scheduled: list[SchedulerOutput] = []
    schedule, prepare = engine.scheduler.schedule, engine.executor.runner.prepare

    def recording_schedule() -> SchedulerOutput:
        scheduled.append(schedule())
        return scheduled[-1]

    def checking_prepare(plan: StepPlan) -> ModelInput:
        sched = scheduled[-1]
        assert plan is sched.plan
        expected = reference_inputs(sched, BLOCK)
        encoded = encode(plan)
        assert encoded.dtype == np.int64
        if through_encoding:
            plan = decode(encoded)
            assert all(r.sampling_params is None for r in plan.new_requests)
        model_input = prepare(plan)
        assert_inputs_match(model_input, expected)
        seen["steps"] += 1
        seen["departures"] += len(plan.finished_ids) + len(plan.preempted_ids)
        seen["joins"] += len(plan.new_requests)
        return model_input

    engine.scheduler.schedule = recording_schedule
    engine.executor.runner.prepare = checking_prepare
    seen = dict(steps=0, departures=0, joins=0, aborted=0)
    tokens: dict[tuple[str, int], list[int]] = {}
    step = 0
    while step <= max(arrival for arrival, *_ in WORKLOAD) or engine.has_unfinished:
        for arrival, request_id, ids, params in WORKLOAD:
            if arrival == step:
                engine.add_request(request_id, ids, params)
        victim = engine.requests.get(ABORTED)
        if victim is not None and victim.num_output_tokens >= 2:
            seen["aborted"] = len(engine.abort(ABORTED))
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        step += 1
    seen["preemptions"] = engine.scheduler.num_preemptions
    seen["prefix_hits"] = engine.kv_cache.prefix_cache_hits
    return tokens, seen


def test_runner_inputs_from_plans_equal_live_requests_and_survive_encoding(model_dir):
    direct, seen = run_workload(make_engine(model_dir), through_encoding=False)
    # The workload did exercise what the plan must carry.
    assert seen["preemptions"] > 0 and seen["prefix_hits"] > 0
    assert seen["joins"] > len(WORKLOAD) + 3  # samples after the fork, and resumed requests
    assert set(direct) >= {("n3", i) for i in range(3)}
    assert len(direct[("plp", 0)]) == 5
    assert seen["aborted"] == 1 and len(direct[(ABORTED, 0)]) == 2

    encoded, seen_encoded = run_workload(make_engine(model_dir), through_encoding=True)
    assert encoded == direct
    assert seen_encoded == seen


def test_finished_rows_leave_the_batch(model_dir):
    engine = make_engine(model_dir)
    for request_id, ids in (("x", prompt(9, 11)), ("y", prompt(6, 12))):
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=3))
    while engine.has_unfinished:
        engine.step()
    assert len(engine.executor.runner.batch) == 2  # their departures travel with the next plan
    z = engine.add_request("z", prompt(5, 13), SamplingParams(temperature=0.0, max_tokens=1))
    engine.step()
    assert engine.executor.runner.batch.row_of == {z.seq_id: 0}
