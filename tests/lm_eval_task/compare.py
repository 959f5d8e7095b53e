"""Checks two lm-evaluation-harness runs of the tiny task agree: Folio's (local-completions)
against lm-eval's own transformers model (hf). Every choice's loglikelihood within 1e-3, the
same is_greedy flags and the same per-document metrics. Reads only the runs' sample files.

    python tests/lm_eval_task/compare.py FOLIO_OUTPUT_DIR HF_OUTPUT_DIR
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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
