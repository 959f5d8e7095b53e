"""Structured output in the engine: each constrained request's grammar as a token mask.

Owns everything llguidance needs at run time: its view of the model's tokenizer (built once, at
the first constrained request, from the model directory's tokenizer.json or a GGUF file's
metadata), a bounded cache of compiled grammars (one pristine matcher per constraint,
deep-copied for each request), each request's matcher, kept in step with the request's output
tokens, and the masks of the batch. Masks are computed on a worker thread while the forward
runs (llguidance releases the GIL), and only when some row of the batch is constrained.

A matcher follows `request.output_token_ids`, whatever appended them, so chunked prefill and
preemption (recompute keeps the output tokens) need nothing special. Speculative drafts
(engine.spec_decode) are cut to what the grammar accepts before they are scheduled
(`allowed_prefix`), and a drafting request gets a mask for each of its verified rows: the
grammar's after each draft before it, its matcher stepped through the drafts and back. This
module never chooses tokens (the sampler does) and never finishes a request itself (the engine
does, when advance() says the grammar is complete).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import torch

from common.gguf_tokenizer import read_gguf_tokenizer
from common.sampling_params import StructuredOutput
from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.grammar import llguidance_grammar

logger = logging.getLogger(__name__)

# Distinct constraints whose compiled grammar is kept: a large schema costs far more to compile
# again than to keep, and a matcher costs little memory until it is used.
GRAMMAR_CACHE_SIZE = 256
# llguidance's own threads for a batch's masks: rows are independent, a few threads suffice.
MASK_THREADS = min(4, os.cpu_count() or 1)
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


@dataclass
class _MatcherState:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # how many of the request's output tokens the matcher has seen


class StructuredOutputManager:
    def __init__(
        self,
        model_path: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: str | torch.device = "cpu",
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="folio-masks")
        self._model_path = Path(model_path)
        self._eos_token_ids = list(eos_token_ids)
        # Built at the first constrained request, as vLLM builds its grammar backend: about 0.9 s
        # holding the interpreter lock for a 50k vocabulary from a GGUF file's metadata (0.4 s
        # of it in llguidance), which every engine start would pay, constrained requests or not.
        # A future: what the build gave, or raised, is kept.
        self._tokenizer: concurrent.futures.Future[llguidance.LLTokenizer | None] | None = None
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        # Weak keys: a request dropped without release() (it never should be) cannot leak.
        self._states: weakref.WeakKeyDictionary[Request, _MatcherState] = (
            weakref.WeakKeyDictionary()
        )
        self._words = -(-vocab_size // 32)
        self._bitmask = np.zeros((0, self._words), dtype=np.int32)
        self._bits = _BITS.to(self.device)

    # -- requests ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Compile the request's constraint (cached) and give it a matcher (one per sample when
        n > 1); InvalidRequestError if it does not compile against this model's tokenizer."""
        constraint = request.sampling_params.structured_output
        if constraint is None:
            raise ValueError(f"request {request.request_id!r} has no structured output to compile")
        compiled = self.compile(constraint)
        for sequence in request.samples or [request]:
            self._states[sequence] = _MatcherState(compiled.deep_copy())

    def release(self, request: Request) -> None:
        self._states.pop(request, None)

    def compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint, compiled once and kept while it is used."""
        matcher = self._compiled.get(constraint)
        if matcher is not None:
            self._compiled.move_to_end(constraint)
            return matcher
        if self._tokenizer is None:
            self._tokenizer = self._worker.submit(
                _load_tokenizer, self._model_path, self.vocab_size, self._eos_token_ids
            )
        try:
            tokenizer = self._tokenizer.result()
        except Exception as exc:  # a tokenizer.json llguidance cannot read
            raise InvalidRequestError(
                f"structured_output is not available for this model: {exc}"
            ) from None
        if tokenizer is None:
            raise InvalidRequestError(
                "structured_output needs the model directory's tokenizer.json, which this "
                "model does not have"
            )
        try:
            grammar = llguidance_grammar(constraint)
        except ValueError as exc:
            raise InvalidRequestError(f"structured_output is invalid: {exc}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_output is invalid: {matcher.get_error()}")
        self._compiled[constraint] = matcher
        if len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher

    def allowed_prefix(self, request: Request, tokens: list[int]) -> int:
        """How many leading `tokens` the request's grammar accepts after its output so far."""
        return self._synced(request).matcher.validate_tokens(tokens)

    def advance(self, request: Request) -> bool:
        """Feed the matcher the request's new output tokens; True when the grammar is complete
        (nothing but EOS may follow) or the tokens broke it, so the request must end."""
        state = self._synced(request)
        if state.matcher.is_error():
            logger.warning(
                "request %s left its grammar: %s", request.request_id, state.matcher.get_error()
            )
        return state.matcher.is_stopped()

    # -- masks ------------------------------------------------------------------------------

    def start_masks(
        self, requests: Sequence[Request]
    ) -> concurrent.futures.Future[torch.Tensor] | None:
        """Begin the batch's mask (Sampler.sample's `disallowed`) on the worker thread; take the
        result after the forward. None, at no cost, when no live request is constrained."""
        if not self._states:
            return None
        rows = [
            i for i, r in enumerate(requests) if r.sampling_params.structured_output is not None
        ]
        if not rows:
            return None
        return self._worker.submit(self.disallowed, requests, rows)

    def disallowed(self, requests: Sequence[Request], rows: Sequence[int]) -> torch.Tensor:
        """bool [sampled rows, vocab_size], True where the grammar of requests[i], i in rows,
        forbids the token next; the other requests' rows are all False. A request has one
        sampled row, or 1 + len(spec_token_ids) when it drafted (engine.spec_decode.verify's
        layout): the mask before its first draft, then after each draft."""
        counts = [1 + len(r.spec_token_ids) for r in requests]
        firsts = np.cumsum(counts) - counts
        masked: list[int] = []  # the sampled rows the bitmask's rows are, in order
        places: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        for i in rows:
            places.append(
                (self._synced(requests[i]).matcher, len(masked), requests[i].spec_token_ids)
            )
            masked += range(firsts[i], firsts[i] + counts[i])
        if len(self._bitmask) < len(masked):
            self._bitmask = np.zeros((len(masked), self._words), dtype=np.int32)
        bitmask = self._bitmask[: len(masked)]
        # llguidance writes each listed row whole (one bit per token id): reuse needs no
        # clearing; but it stops at a draft that ends the grammar (EOS), leaving the rows after
        # it, whose tokens the request never keeps, as they were: those allow everything.
        drafting = [place for place in places if place[2]]
        for _, j, drafts in drafting:
            bitmask[j + 1 : j + 1 + len(drafts)] = -1
        if drafting:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafting, bitmask.ctypes.data, self._words * 4, len(masked)
            )
        if len(drafting) < len(places):
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, j) for matcher, j, drafts in places if not drafts],
                bitmask.ctypes.data,
                self._words * 4,
                len(masked),
            )
        if self.device.type == "cpu":
            # The inverted bits unpack straight into bools (True = forbidden), single-threaded:
            # torch's threads would contend with the forward running beside this.
            forbidden = torch.from_numpy(
                np.unpackbits(
                    (~bitmask).view(np.uint8),
                    axis=1,
                    count=self.vocab_size,
                    bitorder="little",
                ).view(np.bool_)
            )
        else:
            packed = torch.from_numpy(bitmask).to(self.device)
            forbidden = ((packed[:, :, None] & self._bits) == 0).view(len(masked), -1)
            forbidden = forbidden[:, : self.vocab_size]
        if len(masked) == sum(counts):
            return forbidden
        mask = torch.zeros(sum(counts), self.vocab_size, dtype=torch.bool, device=self.device)
        mask[torch.tensor(masked, device=self.device)] = forbidden
        return mask

    def _synced(self, request: Request) -> _MatcherState:
        """The request's matcher, having consumed exactly its output tokens so far; a request
        not added here (created from one that was) gets one now."""
        state = self._states.get(request)
        if state is None:
            self.add(request)
            state = self._states[request]
        outputs = request.output_token_ids
        if state.num_consumed < len(outputs):
            state.matcher.consume_tokens(outputs[state.num_consumed :])
            state.num_consumed = len(outputs)
        return state


def _load_tokenizer(
    model_path: Path, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer | None:
    """llguidance's tokenizer from the directory's tokenizer.json or a GGUF file's metadata (the
    same JSON, built by common.gguf_tokenizer); None when the directory has none. A failure is
    raised as a RuntimeError with its message alone: the future keeps it for the engine's life,
    and the failed build's frames would keep what they held (a GGUF file's parsed metadata)."""
    try:
        if model_path.suffix == ".gguf":
            tokenizer_json = read_gguf_tokenizer(model_path).fast.to_str()
        elif (model_path / "tokenizer.json").is_file():
            tokenizer_json = (model_path / "tokenizer.json").read_text()
        else:
            return None
        # n_vocab: the model's logits may be wider than the tokenizer (padded vocabularies).
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
    except Exception as exc:
        # Logged once with its traceback (the future keeps the failure for every later request).
        logger.warning("structured output's tokenizer from %s failed", model_path, exc_info=True)
        failure = str(exc)
    raise RuntimeError(failure)
