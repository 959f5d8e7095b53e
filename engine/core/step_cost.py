"""What an engine step costs in seconds: the step cost model (`folio bench profile` fits it,
simulated engines run on it) and its live form, which the scheduler asks how long a queue will
take (deadline admission, the load an engine reports to routers).

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
        # Queue waits, predicted at admission and then measured, summed with recent ones
        # weighted most: what arrives later (a tenant within its share taking a slot, a
        # preempted request put back ahead) lengthens waits beyond what the queue showed.
        self._predicted_waits = 0.0
        self._measured_waits = 0.0

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        modelled = self.model.step_seconds(num_prefill_tokens, num_decodes)
        if modelled > 0 and seconds > 0:
            self.ratio += RATIO_WEIGHT * (seconds / modelled - self.ratio)

    def observe_wait(self, predicted: float, measured: float) -> None:
        """A request predicted to wait `predicted` seconds for its first step waited
        `measured`."""
        self._predicted_waits += WAIT_WEIGHT * (predicted - self._predicted_waits)
        self._measured_waits += WAIT_WEIGHT * (measured - self._measured_waits)

    @property
    def wait_ratio(self) -> float:
        """Measured over predicted queue waits lately (1 before any wait was measured)."""
        if self._predicted_waits <= 0.0:
            return 1.0
        return self._measured_waits / self._predicted_waits

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
