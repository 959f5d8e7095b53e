"""Pooling: an embedding request's hidden states -> one vector.

How a model pools comes from its sentence-transformers config when the directory has one
(modules.json naming a Pooling module, whose config.json sets one pooling_mode_*): the last
token's hidden state, the mean over the prompt, or the first token's (CLS). Without one a model
pools its last token's: a decoder attends leftwards, so only the last token has seen the whole
prompt. Matryoshka truncation (`dimensions`) is allowed where config.json declares it
(`matryoshka_dimensions`: the sizes it was trained for; or `is_matryoshka`: any size).

The model runner feeds the `Pooler` each step's hidden states (after the model's final norm) of
the embedding requests in the step, chunk by chunk when a prompt is prefilled in several steps;
it gives back the pooled vector of each request whose prompt ends in the step. `finish` cuts
one to its `dimensions` and L2-normalises it. This module never schedules and never sees a
Request: it knows seq ids and plain ints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams
from engine.models.config import ModelConfig

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling modes -> ours; any other mode (max, mean_sqrt_len_tokens,
# weightedmean) is refused at start rather than served wrong.
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_MODULE = "sentence_transformers.models."
# The modules of a sentence-transformers pipeline Folio applies: the model itself, the pooling,
# and L2 normalisation (every embedding is normalised anyway).
_ST_APPLIED = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str
    # The model ships a sentence-transformers config: an embedding model (--runner auto serves
    # it for embeddings only).
    sentence_transformers: bool
    hidden_size: int
    is_matryoshka: bool = False
    # The sizes a Matryoshka model may be cut to; None: any size up to hidden_size.
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> PoolingConfig:
        """ValueError naming the file when the sentence-transformers config asks for what
        Folio does not do (another module, another pooling mode)."""
        path = Path(path)
        if path.suffix == ".gguf":  # a GGUF file: a causal model with no pooling config
            hidden_size = ModelConfig.from_dir(path).hidden_size
            return cls("last", sentence_transformers=False, hidden_size=hidden_size)
        config = json.loads((path / "config.json").read_text())
        dimensions = config.get("matryoshka_dimensions")
        modules_file = path / "modules.json"
        pooling_type = "last"
        if modules_file.exists():
            for module in json.loads(modules_file.read_text()):
                kind = str(module.get("type", "")).removeprefix(_ST_MODULE)
                if kind not in _ST_APPLIED:
                    raise ValueError(
                        f"{modules_file} lists the module {module.get('type')!r}; Folio applies "
                        f"only {', '.join(sorted(_ST_APPLIED))}"
                    )
                if kind == "Pooling":
                    pooling_dir = path / module.get("path", "")
                    pooling_type = _st_pooling_type(pooling_dir / "config.json")
        return cls(
            pooling_type,
            sentence_transformers=modules_file.exists(),
            hidden_size=int(config["hidden_size"]),
            is_matryoshka=bool(config.get("is_matryoshka")) or dimensions is not None,
            matryoshka_dimensions=tuple(int(d) for d in dimensions) if dimensions else None,
        )

    def check(self, params: PoolingParams) -> None:
        """InvalidRequestError (param "dimensions") unless the model can serve `params`."""
        dimensions = params.dimensions
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError(
                f"dimensions: this model does not support Matryoshka truncation (its config.json "
                f"declares neither matryoshka_dimensions nor is_matryoshka); leave dimensions "
                f"unset for its {self.hidden_size} dimensions",
                "dimensions",
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise InvalidRequestError(
                f"dimensions must be one of {list(allowed)} for this model, got {dimensions}",
                "dimensions",
            )
        if dimensions > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most {self.hidden_size} for this model, got {dimensions}",
                "dimensions",
            )


def _st_pooling_type(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    modes = [name for name, on in config.items() if name.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_file} sets the pooling modes {modes}; Folio pools with exactly one of "
            f"{', '.join(_ST_MODES)}"
        )
    if not config.get("include_prompt", True):
        raise ValueError(f"{config_file} sets include_prompt false, which Folio does not do")
    return _ST_MODES[modes[0]]


@dataclass(slots=True)
class PoolSlice:
    """An embedding request's new tokens in one step: flat rows start .. start + count - 1 of
    the step's hidden states, at positions first_position .. of its prompt."""

    seq_id: int
    start: int
    count: int
    first_position: int
    # Its prompt's last token is among them: its vector is due this step.
    completes: bool


class Pooler:
    """Pools the embedding requests of each step; keeps what a chunked prompt's earlier steps
    gave (the running sum for mean pooling, the first token for CLS) until its last chunk."""

    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {pooling_type!r}")
        self.pooling_type = pooling_type
        self._partial: dict[int, torch.Tensor] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Requests that left the batch (finished, aborted, preempted: a preempted one starts
        again from its first token)."""
        for seq_id in seq_ids:
            self._partial.pop(seq_id, None)

    def pool(self, hidden: torch.Tensor, slices: Iterable[PoolSlice]) -> torch.Tensor | None:
        """[requests completing this step, hidden] float32 vectors, in the slices' order; None
        when none completes."""
        done = []
        partial = self._partial
        for s in slices:
            rows = hidden[s.start : s.start + s.count]
            if self.pooling_type == "last":
                if s.completes:
                    done.append(rows[-1].float())
                continue
            if self.pooling_type == "cls":
                if s.first_position == 0:
                    partial[s.seq_id] = rows[0].float()
                if s.completes:
                    done.append(partial.pop(s.seq_id))
                continue
            total = rows.float().sum(0)
            previous = partial.get(s.seq_id)
            if previous is not None:
                total += previous
            if s.completes:
                partial.pop(s.seq_id, None)
                done.append(total / (s.first_position + s.count))
            else:
                partial[s.seq_id] = total
        return torch.stack(done) if done else None


def finish(vector: torch.Tensor, dimensions: int | None) -> list[float]:
    """A pooled vector as the caller gets it: its first `dimensions` values (all with None),
    L2-normalised (after the cut, so a Matryoshka prefix is a unit vector too)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1).tolist()
