"""The whole engine with attention_backend="triton" (kernels under the interpreter on CPU, or
native with FOLIO_KERNEL_DEVICE=cuda) gives exactly the greedy tokens of the torch backend,
over steps that mix prefill and decode, with chunked prefill and a prefix-cache hit, on a
full-attention model and sliding-window ones (gpt-oss's with attention sinks)."""

from __future__ import annotations

import pytest
from kernel_utils import DEVICE

from common.config import EngineConfig
from common.sampling_params import SamplingParams
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
