"""What an engine step costs in seconds: the step cost model (`folio bench profile` fits it,
simulated engines run on it) and its live form, which the scheduler asks how long a queue will
take (deadline admission, the load an engine reports to routers); and how the queue waits
predicted so turned out, per class of request (QueueWaits), to correct later predictions.

A step costs fixed + per prefill token x prefill tokens + per decoding sequence x decoding
sequences. The live model keeps the profile's shape and rescales it to the step times this
engine actually measures (an exponentially weighted ratio of measured to modelled seconds), so
a profile from another machine, or none, converges on this one's speed. Arithmetic only: it
never times anything itself and never imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

# The model an engine without a profile starts from (a small model on a CPU): its scale is
# corrected by the first measured steps.
DEFAULT_FIXED_SECONDS = 0.02
DEFAULT_PREFILL_TOKEN_SECONDS = 0.0002
DEFAULT_DECODE_SEQUENCE_SECONDS = 0.0005
# Weight of one measured step in the running ratio: about the last 50 steps count.
RATIO_WEIGHT = 0.02
# Weight of one measured queue wait in the running sums of waits: about the last 50 count.
WAIT_WEIGHT = 0.02
# Classes of requests whose queue waits are kept apart at most (the least recent go first).
MAX_WAIT_CLASSES = 1024


@dataclass(frozen=True)
class StepCostModel:
    """Seconds one engine step takes: fixed + per prefill token + per decoding sequence."""

    fixed_seconds: float
    prefill_token_seconds: float
    decode_sequence_seconds: float

    def step_seconds(self, num_prefill_tokens: int, num_decodes: int) -> float:
        return (
            self.fixed_seconds
            + self.prefill_token_seconds * num_prefill_tokens
            + self.decode_sequence_seconds * num_decodes
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepCostModel:
        fields = json.loads(path.read_text())
        return cls(
            float(fields["fixed_seconds"]),
            float(fields["prefill_token_seconds"]),
            float(fields["decode_sequence_seconds"]),
        )

    @classmethod
    def load_or_default(cls, path: Path) -> StepCostModel:
        """The profile at `path`, or the default model when there is none (or it is unreadable:
        live timings correct it either way)."""
        try:
            return cls.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            return cls(
                DEFAULT_FIXED_SECONDS,
                DEFAULT_PREFILL_TOKEN_SECONDS,
                DEFAULT_DECODE_SEQUENCE_SECONDS,
            )


class LiveStepCost:
    """The step cost model rescaled to this engine's measured steps."""

    def __init__(self, model: StepCostModel) -> None:
        self.model = model
        self.ratio = 1.0  # measured / modelled seconds, weighted towards recent steps

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        modelled = self.model.step_seconds(num_prefill_tokens, num_decodes)
        if modelled > 0 and seconds > 0:
            self.ratio += RATIO_WEIGHT * (seconds / modelled - self.ratio)

    def step_seconds(self, num_prefill_tokens: int, num_decodes: int) -> float:
        return self.ratio * self.model.step_seconds(num_prefill_tokens, num_decodes)

    @property
    def prefill_token_seconds(self) -> float:
        return self.ratio * self.model.prefill_token_seconds

    def seconds_to_prefill(self, num_tokens: int, num_decodes: int, token_budget: int) -> float:
        """How long until `num_tokens` prefill tokens are computed, beside `num_decodes`
        sequences decoding one token a step, with `token_budget` tokens per step."""
        per_step = max(1, token_budget - num_decodes)
        steps = max(1, math.ceil(num_tokens / per_step))
        return self.ratio * (
            steps * self.model.step_seconds(0, num_decodes)
            + self.model.prefill_token_seconds * num_tokens
        )


class QueueWaits:
    """How queue waits predicted at admission turned out, per class of request (its tenant
    and priority: under fair or priority scheduling one class's requests jump the queue that
    another's wait in): running sums of predicted and measured waits, recent ones weighted
    most. What arrives after a prediction (a tenant within its share taking a slot, a
    preempted request put back ahead) makes waits longer than the queue showed."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, int], tuple[float, float]] = {}  # (predicted, measured)

    def observe(self, key: tuple[str, int], predicted: float, measured: float) -> None:
        sums = self._sums.pop(key, (0.0, 0.0))  # re-inserted: the most recent last
        self._sums[key] = (
            sums[0] + WAIT_WEIGHT * (predicted - sums[0]),
            sums[1] + WAIT_WEIGHT * (measured - sums[1]),
        )
        if len(self._sums) > MAX_WAIT_CLASSES:
            del self._sums[next(iter(self._sums))]

    def ratio(self, key: tuple[str, int]) -> float:
        """Measured over predicted waits lately (1 before any wait of the class counted)."""
        predicted, measured = self._sums.get(key, (0.0, 0.0))
        return measured / predicted if predicted > 0.0 else 1.0
