"""The whole engine with attention_backend="triton" (kernels under the interpreter on CPU, or
native with FOLIO_KERNEL_DEVICE=cuda) gives exactly the greedy tokens of the torch backend,
over steps that mix prefill and decode, with chunked prefill and a prefix-cache hit, on a
full-attention model and sliding-window ones (gpt-oss's with attention sinks); steps that
verify drafts replay the decode graphs."""

from __future__ import annotations

import pytest
from kernel_utils import DEVICE

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.engine import LLMEngine
from tiny_models import MOE_VARIANTS, VARIANTS, make_checkpoint


def greedy_tokens(directory, backend: str, device: str) -> tuple[dict[str, list[int]], int]:
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            device=device,
            attention_backend=backend,
            block_size=4,
            num_kv_blocks=48,
            max_num_batched_tokens=16,
            max_num_seqs=4,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = {"a": list(range(3, 26)), "b": [7, 100, 12, 9, 44], "c": list(range(3, 26))[:17]}
    tokens: dict[str, list[int]] = {}
    engine.add_request("a", prompts["a"], params)
    engine.add_request("b", prompts["b"], params)
    # "c" arrives while a and b decode: its prefill mixes with their decodes and hits a's blocks.
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("c", prompts["c"], params)
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, engine.kv_cache.prefix_cache_hits


# Gemma 3 and gpt-oss: sliding windows of 3 under blocks of 4, in KV groups of their own;
# gpt-oss's sinks in the Triton kernel and the torch backend's plain path.
@pytest.mark.parametrize("variant", ["llama-gqa3-tied-llama3rope", "gemma3-window3", "gpt-oss"])
def test_triton_backend_gives_the_torch_backend_greedy_tokens(tmp_path, variant):
    make_checkpoint(tmp_path, *{**VARIANTS, **MOE_VARIANTS}[variant])
    expected, _ = greedy_tokens(tmp_path, "torch", "cpu")
    got, hits = greedy_tokens(tmp_path, "triton", DEVICE)
    assert hits > 0  # c's first blocks came from the prefix cache
    assert got == expected
    assert all(len(t) == 6 for t in got.values())


class RecordedReplays:
    """The runner's decode graphs, each replay's size recorded. Off a GPU there are none: a
    replay there runs the model eagerly over what a captured graph reads, the first `size` rows
    of the runner's persistent buffers, so the rows prepare() writes for a graph are checked on
    the CPU too."""

    def __init__(self, runner, max_num_seqs: int) -> None:
        self.runner, self.graphs, self.replayed = runner, runner.graphs, []
        self.sizes = graph_batch_sizes(max_num_seqs)  # the ladder the real graphs capture

    size_for = DecodeGraphs.size_for

    def replay(self, size: int):
        self.replayed.append(size)
        if self.graphs is not None:
            return self.graphs.replay(size)
        return self.runner.run_model(*self.runner.graph_inputs(size))


@pytest.mark.parametrize("graph_rows", [8, 2])
def test_verification_steps_replay_decode_graphs_with_the_tokens_without_drafts(
    tmp_path, graph_rows
):
    """A step that only verifies drafts replays the decode graph of its tokens as one-token rows
    (a real CUDA graph on a GPU), and the greedy tokens equal the torch backend's without
    speculation. With graphs of at most 2 rows, a verification step of more tokens runs eagerly
    as one-token rows all the same (the arithmetic the graphs replay)."""
    make_checkpoint(tmp_path, *VARIANTS["llama"])
    # The tiny model's greedy continuation of this prompt repeats itself: drafts get accepted.
    prompt = [68, 94, 138, 10, 122, 66, 16, 43] * 3
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def greedy(engine: LLMEngine) -> list[int]:
        engine.add_request("r", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished:
            for out in engine.step():
                tokens.extend(out.new_token_ids)
        return tokens

    expected = greedy(
        LLMEngine(
            EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, enforce_eager=True)
        )
    )
    spec = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            device=DEVICE,
            attention_backend="triton",
            block_size=4,
            num_kv_blocks=48,
            max_num_seqs=8,
            speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 1}',
        )
    )
    assert spec.drafter is not None
    spec.drafter.measured = None  # keeps drafting whatever the machine's load (test_spec_decode)
    runner = spec.executor.runner
    replays = runner.graphs = RecordedReplays(runner, max_num_seqs=graph_rows)
    eager_rows: list[tuple[int, int, bool]] = []  # (tokens, one-token rows, verifies)
    run_model = runner.run_model

    def recorded_run_model(input_ids, positions, meta, verifies=False):
        eager_rows.append((len(input_ids), meta.num_decodes == meta.num_reqs, verifies))
        return run_model(input_ids, positions, meta, verifies)

    runner.run_model = recorded_run_model
    assert greedy(spec) == expected
    assert spec.stats().spec_num_accepted_tokens > 0
    # One request: a plain decode replays a graph of 1 row; a verification, of its 2-4 tokens.
    assert any(size > 1 for size in replays.replayed)
    verified_eagerly = [(n, rows) for n, rows, verifies in eager_rows if verifies]
    if graph_rows == 2:
        assert any(n > 2 for n, _ in verified_eagerly)
    assert all(rows for _, rows in verified_eagerly)
