"""`folio bench profile`: measure the real engine's step times and fit the step cost model the
simulated engine runs on (engine/simulated.py): seconds = fixed + per prefill token x prefill
tokens + per decoding sequence x decoding sequences.

It times prefill steps of several prompt lengths and decode steps at several batch sizes, fits
the three coefficients by least squares, prints the measurements next to what the fit predicts,
and writes the model as JSON (--output, by default where `folio engine --simulate` looks).
A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from common.config import default_step_cost_path
from common.flags import flag


@dataclass
class ProfileShapes:
    """Profile."""

    prefill_lengths: str = flag("32,128,256,512", "prompt lengths of prefill steps")
    decode_batches: str = flag("1,8,32,64", "batch sizes of decode steps")
    repeats: int = flag(3, "timed steps per shape")
    # flag returns a dataclasses.field, which ruff does not know it for (as in common.config).
    output: Path = flag(factory=default_step_cost_path, help="where the model goes")  # noqa: RUF009


def run_profile(args: argparse.Namespace) -> None:
    import numpy as np

    from common.config import engine_config_from_args
    from common.sampling_params import SamplingParams
    from engine.engine import LLMEngine
    from engine.simulated import StepCostModel

    config = engine_config_from_args(args)
    config.enable_prefix_caching = False  # every prefill computes its whole prompt
    engine = LLMEngine(config)
    rng = random.Random(0)
    counter = iter(range(10**9))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(32, engine.vocab_size) for _ in range(length)]

    samples: list[tuple[int, int, float]] = []  # (prefill tokens, decodes, seconds)
    rows: list[tuple[str, int, int, float]] = []  # (shape, prefill tokens, decodes, median)
    for length in (int(x) for x in args.prefill_lengths.split(",")):
        times = []
        for _ in range(args.repeats + 1):  # the first of each shape warms up
            engine.add_request(f"p{next(counter)}", prompt(length), SamplingParams(max_tokens=1))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            while engine.has_unfinished:
                engine.step()
        samples += [(length, 0, t) for t in times[1:]]
        rows.append((f"prefill {length:4d} tokens", length, 0, statistics.median(times[1:])))
    for batch in (int(x) for x in args.decode_batches.split(",")):
        for _ in range(batch):
            params = SamplingParams(max_tokens=args.repeats + 3, ignore_eos=True)
            engine.add_request(f"d{next(counter)}", prompt(16), params)
        engine.step()  # the batch's prefill
        engine.step()  # a first decode step, as warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        while engine.has_unfinished:
            engine.step()
        samples += [(0, batch, t) for t in times]
        rows.append((f"decode {batch:4d} sequences", 0, batch, statistics.median(times)))
    engine.close()

    design = np.array([[1.0, p, d] for p, d, _ in samples])
    seconds = np.array([t for _, _, t in samples])
    (fixed, per_token, per_seq), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    model = StepCostModel(*(max(float(x), 0.0) for x in (fixed, per_token, per_seq)))
    print(f"engine step times ({config.device}, {engine.dtype_name}), median of {args.repeats}:")
    for shape, p, d, median in rows:
        print(
            f"  {shape:22s} {median * 1e3:8.1f} ms   fit {model.step_seconds(p, d) * 1e3:8.1f} ms"
        )
    print(
        f"fitted: {model.fixed_seconds * 1e3:.2f} ms per step + "
        f"{model.prefill_token_seconds * 1e3:.3f} ms per prefill token + "
        f"{model.decode_sequence_seconds * 1e3:.3f} ms per decoding sequence"
    )
    model.save(args.output)
    print(f"wrote {args.output}")
