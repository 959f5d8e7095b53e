"""How far speculation can take `folio bench spec`'s workloads on the default model, whatever
the verification costs: `python -m bench.spec_replay [--spec-tokens 1,2,3,4]
[--verify-costs 1,1.2,1.35,1.5,1.8] [--max-tokens 128]`.

Runs the engine without speculation on each workload's prompts in turn (greedy, bench spec's
chat prompts and output length), then replays the ngram and suffix proposers offline over those
very outputs, for each fixed draft length k: at each step the proposer drafts up to k tokens
from the text so far (suffix also from the outputs before it, as one bench spec turn feeds
them), the drafts count as accepted up to the first that differs from the greedy output, and
the text advances by those plus one, as verification does. It prints the decode steps, the
drafts and acceptance, and the decode speed-up over one token a step if verifying cost nothing
(tokens per step: no adaptive length, gate or faster kernel can beat it with this proposer and
model), and with --verify-costs (a step verifying j drafts costs the j-th figure, a plain step
1: measure them on the machine) the speed-up those costs allow. Prefill is left out: decode
steps only. A benchmark, not a test: it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.spec import COPY_HEAVY, OPEN_ENDED

# A proposer as the replay calls it: (the text so far, k) -> up to k drafted tokens.
Propose = Callable[[Sequence[int], int], list[int]]
# Told each request's output once it is done (suffix's window of recent outputs).
Finished = Callable[[list[int]], None]


@dataclass
class Replay:
    """One proposer's replay over a workload's outputs at one draft length."""

    tokens: int = 0  # output tokens after each prompt's first (decode steps make them)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    # Steps by how many drafts they verified.
    by_drafts: dict[int, int] = field(default_factory=dict)

    def cost(self, costs: Sequence[float]) -> float:
        """The steps' time in plain steps, a step verifying j drafts costing costs[j]."""
        return sum(costs[j] * count for j, count in self.by_drafts.items())


def replay(
    outputs: list[tuple[list[int], list[int]]], propose: Propose, finished: Finished, k: int
) -> Replay:
    """Replay `propose` over (prompt, greedy output) pairs in turn, drafting up to k tokens a
    step; `finished` hears each output once its request is done."""
    result = Replay()
    for prompt, output in outputs:
        done = 1  # the first output token comes from the prefill
        while done < len(output):
            draft = propose(prompt + output[:done], k)
            accepted = 0
            while (
                accepted < len(draft)
                and done + accepted < len(output)
                and draft[accepted] == output[done + accepted]
            ):
                accepted += 1
            result.steps += 1
            result.drafted += len(draft)
            result.accepted += accepted
            result.by_drafts[len(draft)] = result.by_drafts.get(len(draft), 0) + 1
            done += accepted + 1
        result.tokens += len(output) - 1
        finished(output)
    return result


def proposers() -> dict[str, Callable[[], tuple[Propose, Finished]]]:
    """Each method's proposer with its defaults, built afresh per replay (suffix's window of
    recent outputs fills as the replay goes)."""
    from common.speculative import SpeculativeConfig
    from engine.spec_decode.ngram import propose_ngram
    from engine.spec_decode.suffix import SuffixIndex

    defaults = SpeculativeConfig("ngram")

    def ngram() -> tuple[Propose, Finished]:
        low, high = defaults.prompt_lookup_min, defaults.prompt_lookup_max
        return (lambda tokens, k: propose_ngram(tokens, k, low, high)), (lambda output: None)

    def suffix() -> tuple[Propose, Finished]:
        index = SuffixIndex(
            defaults.suffix_decoding_max_tree_depth, defaults.suffix_decoding_max_cached_requests
        )
        return index.propose, index.finished

    return {"ngram": ngram, "suffix": suffix}


def greedy_outputs(max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each workload's (prompt, greedy output) pairs, the engine without speculation."""
    from common.config import EngineConfig
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer
    from engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig())
    try:
        tokenizer = Tokenizer.from_dir(engine.model_path)
        workloads = {}
        for name, chats in (("copy-heavy", COPY_HEAVY), ("open-ended", OPEN_ENDED)):
            pairs = []
            for i, chat in enumerate(chats):
                prompt = tokenizer.encode_chat(chat)
                engine.add_request(
                    f"{name}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
                )
                output: list[int] = []
                while engine.has_unfinished:
                    for out in engine.step():
                        output += out.new_token_ids
                pairs.append((prompt, output))
            workloads[name] = pairs
        return workloads
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-tokens", default="1,2,3,4", help="draft lengths k to replay")
    parser.add_argument(
        "--verify-costs",
        default=None,
        help="a step's time verifying 0, 1, .. drafts, in plain steps (0 drafts: 1)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    args = parser.parse_args()
    lengths = [int(k) for k in args.spec_tokens.split(",")]
    costs = None
    if args.verify_costs:
        costs = [float(c) for c in args.verify_costs.split(",")]
        if len(costs) <= max(lengths):
            parser.error(f"--verify-costs: {max(lengths) + 1} figures needed (0..k drafts)")
    workloads = greedy_outputs(args.max_tokens)
    print(
        f"{'workload':12s} {'method':>7s} {'k':>2s} {'tokens':>6s} {'steps':>5s} "
        f"{'drafted':>7s} {'accept':>6s} {'x free':>6s}" + (" x costs" if costs else "")
    )
    for name, outputs in workloads.items():
        for method, make in proposers().items():
            for k in lengths:
                r = replay(outputs, *make(), k)
                accept = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
                line = (
                    f"{name:12s} {method:>7s} {k:2d} {r.tokens:6d} {r.steps:5d} {r.drafted:7d} "
                    f"{accept:>6s} {r.tokens / r.steps:6.2f}"
                )
                if costs:
                    line += f" {r.tokens / r.cost(costs):7.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
