"""A simulated executor (engine.executor's protocol): the real engine loop, scheduler and KV
cache manager (prefix cache and KV events included), no model. Each step takes the time a cost
model gives for its work (engine/core/step_cost.py: a fixed cost, a cost per prefill token, a
cost per decoding sequence), fitted from a profile of the real engine (`folio bench profile`),
and every sampled token is one placeholder token. Dozens of such engines fit in one process,
so routing across many replicas can be studied on one machine.

A step that overruns its modelled time (the machine's CPU was the limit, not the model) is
counted: the engine's timings report the overrun as a phase of its own, so a benchmark can tell
whether the modelled times held. What needs a model is refused: n > 1, logprobs, prompt
logprobs and structured output. This module never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from common.config import EngineConfig
from common.default_model import resolve_model_path
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.core.kv_cache_manager import kv_groups
from engine.core.outputs import SamplerOutput
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.core.step_cost import StepCostModel
from engine.engine import LLMEngine
from engine.errors import EngineGroupError, InvalidRequestError
from engine.executor import ExecutorOutput
from engine.kv_tiers.book import TierBook
from engine.lora.registry import LoraBackend
from engine.models.config import ModelConfig
from engine.spec_decode.drafter import DraftProposer

# The pool of a simulated engine when neither num_kv_blocks nor a memory budget is meant (it
# has no tensors, so the memory budget means nothing).
DEFAULT_NUM_BLOCKS = 1024
# The placeholder token: a word that tokenizes back to itself when its text is sent again (a
# later turn of a chat quotes the answer), so prefix caching sees what it would see for real.
PLACEHOLDER_TEXT = " the"
BFLOAT16_BYTES = 2


class SimulatedExecutor:
    """Runs no model: a step takes the time the cost model gives for it (scheduling included)
    and samples the placeholder token on every row."""

    dtype_name = "simulated"
    kv_cache_dtype_name = "bfloat16"  # the engine it stands for (kv_block_bytes)
    lora_backend: LoraBackend | None = None  # no model, no adapters
    draft_proposer: DraftProposer | None = None  # no model, no draft model
    max_invariant_rows: int | None = None  # no arithmetic to keep the same

    def __init__(
        self,
        config: EngineConfig,
        cost: StepCostModel,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cost = cost
        self._sleep = sleep
        self.model_path: Path = resolve_model_path(config.model)
        model_config = ModelConfig.from_dir(self.model_path)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        [self.placeholder_token_id] = Tokenizer.from_dir(self.model_path).encode(
            PLACEHOLDER_TEXT, add_special_tokens=False
        )
        self.num_blocks = config.num_kv_blocks or DEFAULT_NUM_BLOCKS
        self.kv_groups = kv_groups(model_config.layer_windows, model_config.num_hidden_layers)
        self.kv_tier_book: TierBook | None = None  # no KV tensors: no tiers
        # K and V of every layer, as the bfloat16 engine it stands for would hold them.
        self.kv_block_bytes = (
            2
            * model_config.num_hidden_layers
            * model_config.num_key_value_heads
            * model_config.head_dim
            * config.block_size
            * BFLOAT16_BYTES
        )
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            self.num_blocks * config.block_size,
        )

    def validate_params(self, params: SamplingParams, vocab_size: int) -> None:
        params.validate(vocab_size)
        for name, value in (
            ("n", params.n > 1),
            ("logprobs", params.logprobs is not None),
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("structured_output", params.structured_output is not None),
        ):
            if value:
                raise InvalidRequestError(f"a simulated engine does not do {name}", name)

    def join(self, request: Request) -> None:
        if request.pooling is not None:  # nothing is kept per request otherwise
            raise InvalidRequestError("a simulated engine does not do embeddings", "pooling")

    def leave(self, request: Request) -> None:
        pass

    def execute(self, step: SchedulerOutput, started: float) -> ExecutorOutput:
        num_decodes = step.num_decodes
        modelled = self.cost.step_seconds(step.total_tokens - num_decodes, num_decodes)
        entered = time.perf_counter()
        left = started + modelled - entered
        if left > 0:
            self._sleep(left)
        rows = len(step.sampling_requests)
        return ExecutorOutput(
            SamplerOutput([self.placeholder_token_id] * rows, [None] * rows),
            forward_seconds=time.perf_counter() - entered,
            modelled_seconds=modelled,
        )

    def constraint_ended(self, request: Request) -> bool:
        return False  # structured output is refused

    def grammar_allows(self, request: Request, tokens: list[int]) -> int:
        return len(tokens)

    def close(self) -> None:
        pass

    def add_failure_listener(self, listener: Callable[[EngineGroupError], None]) -> None:
        pass  # one process, no ranks to lose


def simulated_engine(
    config: EngineConfig, cost: StepCostModel, sleep: Callable[[float], None] = time.sleep
) -> LLMEngine:
    """The engine loop on a simulated executor."""
    return LLMEngine(config, SimulatedExecutor(config, cost, sleep), step_cost=cost)
