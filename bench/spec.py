"""`folio bench spec`: the engine with and without speculative decoding on one workload.

Two workloads of chat prompts: copy-heavy (edit a code file and return it whole, summarize a
text quoting it, a multi-turn chat asking to repeat an earlier answer) and open-ended (stories,
explanations). Each runs at each stream count (requests in flight at once: 1, 16) on an engine
without speculation and on one per --methods entry (all loaded at once, taking turns on each
workload, --repeats times: each engine's fastest turn counts), greedy, and prints output
tokens/s, the mean time per output token (TPOT) of the requests, the acceptance (accepted /
drafted tokens), the ratio of tokens/s to the engine without speculation, and whether the
greedy tokens of every turn are the same as without speculation in the same turn (a later turn
finds the prompts in the prefix cache, and a prompt's last token computed alone runs through
the compiled decode program, whose float rounding may flip an int8 activation code that the
eager prefill's does not: tokens can differ between turns); then how many steps of each engine ran
compiled decode programs (verification steps among them). With --compare-url, once Folio's
engines are closed, the same token ids go to that OpenAI-compatible server (llama-server with
its own speculation on, say: same model file, same streams, greedy, EOS honoured), and each row
prints its figures beside Folio's best method's. A benchmark, not a test: it asserts nothing
and never runs in the suite.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import event_loop
from common.config import QUANTIZATIONS
from common.flags import flag

if TYPE_CHECKING:
    from bench.serve import Prompt


@dataclass
class SpecWorkload:
    """Workload."""

    methods: str = flag(
        "ngram", "comma-separated speculative methods to measure (ngram, suffix, draft_model)"
    )
    draft_model: str | None = flag(
        None, "the draft model's directory (or GGUF file), for --methods draft_model"
    )
    draft_quantization: str | None = flag(
        None,
        "the draft model's weight-only quantization, for draft_model (CPU only)",
        choices=QUANTIZATIONS,
    )
    workloads: str = flag("copy-heavy,open-ended", "comma-separated workloads to run")
    streams: str = flag("1,16", "comma-separated requests in flight at once")
    max_tokens: int = flag(128, "output tokens per request")
    spec_tokens: int = flag(4, "num_speculative_tokens of each method")
    rounds: int = flag(
        1, "times each workload's prompts are sent (each stream sends its next when one ends)"
    )
    repeats: int = flag(
        1,
        "times the engines take turns on each workload and stream count; each engine's fastest "
        "run counts (a shared machine's load spikes only ever slow a run down)",
    )
    compare_url: str | None = flag(
        None,
        "also run both workloads (the same token ids) on this OpenAI-compatible server, e.g. "
        "llama-server with --spec-type ngram-simple, and print Folio's best method / it",
    )
    compare_model: str | None = flag(
        None, "model name sent to --compare-url (default: the first id of its /v1/models)"
    )


CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments."""
    values = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def merge(defaults, overrides):
    merged = dict(defaults)
    merged.update(overrides)
    return merged
'''

TEXT = (
    "The committee met on Tuesday to review the new library budget. Members agreed that the "
    "children's section needs more books, that opening hours should extend to eight in the "
    "evening on weekdays, and that the roof repairs must be finished before winter. The "
    "treasurer warned that the heating costs rose by a third last year."
)

COPY_HEAVY = [
    [
        {
            "role": "user",
            "content": f"Rename the function merge to combine and return the whole "
            f"file, unchanged otherwise:\n\n{CODE}",
        }
    ],
    [
        {
            "role": "user",
            "content": f"Summarize this text, quoting its sentences word for word:\n\n{TEXT}",
        }
    ],
    [
        {"role": "user", "content": "List five tips for writing clean Python code."},
        {
            "role": "assistant",
            "content": "1. Use descriptive names. 2. Keep functions short. "
            "3. Write docstrings. 4. Prefer explicit over implicit. 5. Test your code.",
        },
        {"role": "user", "content": "Repeat your previous answer exactly, then add a sixth tip."},
    ],
    [
        {
            "role": "user",
            "content": f"Add type hints to every function and return the whole file:\n\n{CODE}",
        }
    ],
]
OPEN_ENDED = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "Explain how a rainbow forms."}],
    [{"role": "user", "content": "Give me ideas for a weekend trip in the mountains."}],
    [{"role": "user", "content": "Why do cats purr?"}],
]


@dataclass
class Measured:
    tokens_per_second: float
    tpot_seconds: float
    drafted: int
    accepted: int
    outputs: list[list[int]]


def run_spec_benchmark(args: argparse.Namespace) -> None:
    from common.config import engine_config_from_args
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer
    from engine.engine import LLMEngine

    base = engine_config_from_args(args)
    methods: list[str | None] = [None, *args.methods.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results: dict[tuple[str, int, str | None], Measured] = {}
    chats = {"copy-heavy": COPY_HEAVY, "open-ended": OPEN_ENDED}
    names = args.workloads.split(",")
    if unknown := [name for name in names if name not in chats]:
        raise SystemExit(f"folio bench spec: --workloads: unknown {unknown}, known {list(chats)}")
    # Built first, so that a missing --draft-model or workload is said before any engine loads.
    specs = {method: None if method is None else _spec_config(method, args) for method in methods}
    engines = {}
    for method, spec in specs.items():
        config = engine_config_from_args(args)
        config.speculative_config = None if spec is None else json.dumps(spec)
        engines[method] = LLMEngine(config)
    tokenizer = Tokenizer.from_dir(engines[None].model_path)
    workloads = {name: [tokenizer.encode_chat(m) for m in chats[name]] for name in names}
    warm_up = [prompts[0] for prompts in workloads.values()]
    for engine in engines.values():
        # A request of each workload first: the first steps at a context length pay one-off
        # costs (allocations, kernel selection, a compiled program for that length).
        _measure(engine, warm_up, 1, 1, SamplingParams(max_tokens=8))
    # The engines take turns on each workload, so a shared machine's load drifting during the
    # run weighs on all of them alike; with --repeats, each engine's fastest turn counts.
    # Each turn's tokens, per cell: a turn meets the prefix cache as the previous turns left it
    # (the first computes whole prompts), so a method's tokens are compared with those of the
    # same turn without speculation.
    turns: dict[tuple[str, int, str | None], list[list[list[int]]]] = {}
    for name, prompts in workloads.items():
        for count in streams:
            for _ in range(args.repeats):
                for method, engine in engines.items():
                    m = _measure(engine, prompts, count, args.rounds, params)
                    turns.setdefault((name, count, method), []).append(m.outputs)
                    best = results.get((name, count, method))
                    if best is None or m.tokens_per_second > best.tokens_per_second:
                        results[name, count, method] = m
    compiled = {method: _compiled_steps(engine) for method, engine in engines.items()}
    for engine in engines.values():
        engine.close()
    peer: dict[tuple[str, int], Measured] = {}
    if args.compare_url:
        # After Folio's engines are closed: the peer gets the machine to itself, as they did.
        for name, prompts in workloads.items():
            for count in streams:
                for _ in range(args.repeats):
                    m = event_loop.run(_measure_peer(args, prompts, count))
                    best = peer.get((name, count))
                    if best is None or m.tokens_per_second > best.tokens_per_second:
                        peer[name, count] = m
    draft = ""
    if "draft_model" in methods:
        draft = f", draft model {args.draft_model} ({args.draft_quantization or 'unquantized'})"
    print(
        f"speculative decoding, {base.device}, model {base.model or 'default'}, greedy, "
        f"{args.max_tokens} tokens per request, num_speculative_tokens {args.spec_tokens}, "
        f"fastest of {args.repeats} turns{draft}"
    )
    print(
        f"{'workload':12s} {'streams':>7s} {'method':>11s} {'tok/s':>8s} {'TPOT ms':>8s} "
        f"{'accept':>7s} {'x none':>7s} same"
    )
    for (name, count, method), m in results.items():
        none = results[name, count, None]
        accept = f"{m.accepted / m.drafted:.2f}" if m.drafted else "-"
        same = "yes" if turns[name, count, method] == turns[name, count, None] else "NO"
        print(
            f"{name:12s} {count:7d} {method or 'none':>11s} {m.tokens_per_second:8.1f} "
            f"{m.tpot_seconds * 1e3:8.1f} {accept:>7s} "
            f"{m.tokens_per_second / none.tokens_per_second:7.2f} {same}"
        )
    for method, line in compiled.items():
        print(f"{method or 'none'}: {line}")
    if peer:
        print(f"against {args.compare_url}, same token ids, its fastest of {args.repeats} turns:")
        print(
            f"{'workload':12s} {'streams':>7s} {'tok/s':>8s} {'TPOT ms':>8s} {'accept':>7s} "
            f"{'Folio best':>11s} {'x peer':>7s}"
        )
        for (name, count), m in peer.items():
            method, ours = max(
                ((method, results[name, count, method]) for method in methods),
                key=lambda pair: pair[1].tokens_per_second,
            )
            accept = f"{m.accepted / m.drafted:.2f}" if m.drafted else "-"
            print(
                f"{name:12s} {count:7d} {m.tokens_per_second:8.1f} {m.tpot_seconds * 1e3:8.1f} "
                f"{accept:>7s} {method or 'none':>11s} "
                f"{ours.tokens_per_second / m.tokens_per_second:7.2f}"
            )


async def _measure_peer(args: argparse.Namespace, prompts: list[list[int]], streams: int):
    """_measure's workload on --compare-url: the same prompts in turn, `streams` at a time."""
    from bench.serve import drive, http_client, server_session

    url = args.compare_url.rstrip("/")
    total = max(streams, len(prompts)) * args.rounds
    sent: list[Prompt] = [prompts[i % len(prompts)] for i in range(total)]
    async with server_session(url, args.compare_model, peer=True) as (session, model):
        client = http_client(session, url, model, ignore_eos=False)
        samples, elapsed = await drive(client, sent, args.max_tokens, streams, None, 0)
    tpots = [t for t in (s.tpot for s in samples) if t is not None]
    return Measured(
        tokens_per_second=sum(s.num_tokens for s in samples) / elapsed,
        tpot_seconds=sum(tpots) / max(1, len(tpots)),
        drafted=sum(s.drafted for s in samples),
        accepted=sum(s.accepted for s in samples),
        outputs=[],
    )


def _spec_config(method: str, args: argparse.Namespace) -> dict[str, object]:
    """The --speculative-config of one measured method."""
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": args.spec_tokens}
    if method != "draft_model":
        return spec
    if args.draft_model is None:
        raise SystemExit("folio bench spec: --methods draft_model needs --draft-model DIR")
    spec["model"] = args.draft_model
    if args.draft_quantization is not None:
        spec["quantization"] = args.draft_quantization
    return spec


def _compiled_steps(engine) -> str:
    """How the engine's decode and verification steps ran (warm-up included)."""
    programs = engine.executor.runner.compiled_decode
    if programs is None or not programs.ready:
        return "every step eager (no compiled decode programs)"
    return (
        f"{sum(programs.rows_run.values())} steps compiled, "
        f"{programs.verify_steps_run} of them verification steps"
    )


def _measure(engine, prompts: list[list[int]], streams: int, rounds: int, params) -> Measured:
    """`streams` requests in flight, every prompt (and at least one per stream) `rounds` times,
    prompts taken in turn."""
    before = engine.stats()
    total = max(streams, len(prompts)) * rounds
    submitted = 0
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    tpots: list[float] = []

    def submit() -> None:
        nonlocal submitted
        request_id = f"b{id(tokens)}-{submitted}"
        engine.add_request(request_id, prompts[submitted % len(prompts)], params)
        tokens[request_id] = []
        submitted += 1

    start = time.perf_counter()
    for _ in range(min(streams, total)):
        submit()
    while engine.has_unfinished:
        for out in engine.step():
            now = time.perf_counter()
            tokens[out.request_id] += out.new_token_ids
            first.setdefault(out.request_id, now)
            if out.finished:
                n = len(tokens[out.request_id])
                if n > 1:
                    tpots.append((now - first[out.request_id]) / (n - 1))
                if submitted < total:
                    submit()
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return Measured(
        tokens_per_second=sum(len(t) for t in tokens.values()) / elapsed,
        tpot_seconds=sum(tpots) / max(1, len(tpots)),
        drafted=after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        accepted=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        outputs=[tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("-", 1)[1]))],
    )
