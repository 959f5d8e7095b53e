"""The step plan is plain data: it round-trips through its flat int64 encoding."""

import dataclasses

import numpy as np
import pytest

from common.sampling_params import SamplingParams
from engine.core.step_plan import (
    NewRequestPlan,
    PromptLogprobSpan,
    RunningRequestPlan,
    StepPlan,
    decode,
    encode,
)


def full_plan() -> StepPlan:
    return StepPlan(
        new_requests=[
            NewRequestPlan(7, [1, 2, 3, 4, 5], [9, 4], 4, SamplingParams(temperature=0.5)),
            NewRequestPlan(8, [6], [], 0, SamplingParams()),
        ],
        running_requests=[RunningRequestPlan(3, [42], [11]), RunningRequestPlan(5, [], [])],
        finished_ids=[1, 2],
        preempted_ids=[6],
        scheduled_ids=[3, 5, 7, 8],
        num_computed_tokens=[17, 30, 4, 0],
        num_new_tokens=[1, 1, 1, 1],
        num_samples=[1, 1, 3, 0],
        num_decodes=4,
        block_copies=[(2, 12), (12, 13)],
        prompt_logprob_spans=[PromptLogprobSpan(3, 1, 1)],
    )


def test_encoding_round_trips_everything_but_sampling_params():
    plan = full_plan()
    encoded = encode(plan)
    assert encoded.dtype == np.int64 and encoded.ndim == 1
    decoded = decode(encoded)
    expected = dataclasses.replace(
        plan,
        new_requests=[dataclasses.replace(r, sampling_params=None) for r in plan.new_requests],
    )
    assert decoded == expected
    assert plan.without_sampling_params() == expected
    # The plan also survives a plain list of ints (what protobuf's repeated int64 carries).
    assert decode(encoded.tolist()) == expected


def test_empty_plan_round_trips():
    assert decode(encode(StepPlan())) == StepPlan()


def test_other_version_and_trailing_values_are_refused():
    encoded = encode(full_plan())
    other = encoded.copy()
    other[0] += 1
    with pytest.raises(ValueError, match="version"):
        decode(other)
    with pytest.raises(ValueError, match="trailing"):
        decode(np.append(encoded, 0))
