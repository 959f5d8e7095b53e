"""Compares two lm-evaluation-harness runs of the tiny task, reading only their sample files.

Checks that Folio's run (local-completions) agrees with lm-eval's own transformers model (hf):
every choice's loglikelihood within 1e-3, the same is_greedy flags and the same per-document
metrics. With --report, prints a quantized run's loglikelihoods next to the unquantized run's,
choice by choice, and which answers changed (a report: exit 0).

    python tests/lm_eval_task/compare.py FOLIO_OUTPUT_DIR HF_OUTPUT_DIR
    python tests/lm_eval_task/compare.py --report UNQUANTIZED_DIR QUANTIZED_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOLERANCE = 1e-3
METRICS = ("acc", "acc_norm")


def samples(output_dir: str) -> dict[int, dict]:
    [path] = Path(output_dir).rglob("samples_folio_tiny_mc_*.jsonl")
    with path.open() as lines:
        return {doc["doc_id"]: doc for doc in map(json.loads, lines)}


def main(folio_dir: str, hf_dir: str) -> int:
    folio, hf = samples(folio_dir), samples(hf_dir)
    assert folio.keys() == hf.keys(), "the runs scored different documents"
    worst = 0.0
    problems = []
    for doc_id in sorted(folio):
        ours, theirs = folio[doc_id], hf[doc_id]
        for choice, ((ll, greedy), (ref_ll, ref_greedy)) in enumerate(
            zip(ours["filtered_resps"], theirs["filtered_resps"], strict=True)
        ):
            diff = abs(float(ll) - float(ref_ll))
            worst = max(worst, diff)
            if diff > TOLERANCE or greedy != ref_greedy:
                problems.append(
                    f"doc {doc_id} choice {choice}: folio ({ll}, {greedy}), "
                    f"hf ({ref_ll}, {ref_greedy})"
                )
        for metric in METRICS:
            if ours[metric] != theirs[metric]:
                problems.append(f"doc {doc_id}: {metric} {ours[metric]} vs {theirs[metric]}")
    means = {m: sum(d[m] for d in folio.values()) / len(folio) for m in METRICS}
    print(
        f"{len(folio)} documents; largest loglikelihood difference {worst:.2e}; "
        + ", ".join(f"{m} {v:.3f}" for m, v in means.items())
    )
    for problem in problems:
        print(problem)
    return 1 if problems else 0


def report(base_dir: str, other_dir: str) -> int:
    base, other = samples(base_dir), samples(other_dir)
    assert base.keys() == other.keys(), "the runs scored different documents"
    diffs, changed = [], 0
    print(f"{'doc':>3}  {'choice':24s} {'unquantized':>12s} {'quantized':>10s} {'diff':>8s}")
    for doc_id in sorted(base):
        ours = [float(ll) for ll, _ in base[doc_id]["filtered_resps"]]
        theirs = [float(ll) for ll, _ in other[doc_id]["filtered_resps"]]
        for choice, ll, q_ll in zip(base[doc_id]["doc"]["choices"], ours, theirs, strict=True):
            diffs.append(q_ll - ll)
            print(f"{doc_id:3d}  {choice[:24]:24s} {ll:12.4f} {q_ll:10.4f} {q_ll - ll:+8.4f}")
        if ours.index(max(ours)) != theirs.index(max(theirs)):
            changed += 1
            print(f"     doc {doc_id}: the chosen answer changed")
    magnitudes = [abs(d) for d in diffs]
    accuracy = {
        name: sum(d["acc"] for d in run.values()) / len(run)
        for name, run in (("unquantized", base), ("quantized", other))
    }
    print(
        f"{len(base)} documents, {len(diffs)} choices: loglikelihood difference mean "
        f"{sum(magnitudes) / len(magnitudes):.4f}, largest {max(magnitudes):.4f}; answers changed "
        f"{changed}/{len(base)}; acc {accuracy['unquantized']:.3f} unquantized, "
        f"{accuracy['quantized']:.3f} quantized"
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        sys.exit(report(*sys.argv[2:]))
    sys.exit(main(*sys.argv[1:]))
