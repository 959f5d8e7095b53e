"""KV memory of a long conversation on a sliding-window model against its full-attention twin:
`python -m bench.sliding_window_kv [--tokens 16000] [--window 512] [--chunk 512]`.

Builds a tiny random-weight Gemma 3 (6 layers, Gemma's pattern: five local layers with a
`--window`-token window, then a global one) and the same model with every layer global, runs
one conversation of `--tokens` prompt tokens and 64 generated ones through the engine on each
(prefill in chunks of `--chunk` tokens), and prints the KV memory its blocks hold when the
conversation is at its longest (its last step) and at the peak of the run, in blocks of one
layer's K and V (a block id of the pool holds one KV group's layers: engine.core.
kv_cache_manager), and the sliding model's share of the full model's. A benchmark, not a test:
it asserts nothing and never runs in the suite.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.engine import LLMEngine

BLOCK = 16
LAYERS = 6
GENERATED = 64


def build(directory: Path, window: int, sliding: bool, max_positions: int) -> None:
    """A seeded random tiny Gemma 3; with `sliding` False every layer attends fully."""
    torch.manual_seed(0)
    layer_types = [
        "full_attention" if (i + 1) % 6 == 0 or not sliding else "sliding_attention"
        for i in range(LAYERS)
    ]
    config = Gemma3TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_positions,
        sliding_window=window,
        layer_types=layer_types,
        query_pre_attn_scalar=32,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)


def held_layer_blocks(engine: LLMEngine) -> int:
    """KV memory held by live requests, in blocks of one layer's K and V."""
    slots = engine.executor.runner.kv_groups.num_slots  # type: ignore[attr-defined]
    return engine.kv_cache.num_used_blocks * slots


def run(directory: Path, tokens: int, chunk: int) -> tuple[int, int, float]:
    """(layer-blocks at the conversation's last step, at the run's peak, seconds)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            block_size=BLOCK,
            max_num_batched_tokens=chunk,
            max_num_seqs=1,
            max_model_len=tokens + GENERATED + BLOCK,
            kv_cache_memory_bytes=256 * 1024**2,
        )
    )
    prompt = torch.randint(3, 250, (tokens,), generator=torch.Generator().manual_seed(1))
    engine.add_request(
        "conversation",
        prompt.tolist(),
        SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True),
    )
    last = peak = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        if engine.has_unfinished:  # a finished request's blocks are already freed
            last = held_layer_blocks(engine)
            peak = max(peak, last)
    return last, peak, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16000, help="prompt tokens")
    parser.add_argument("--window", type=int, default=512, help="the local layers' window")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as root:
        for name, sliding in (("full attention", False), ("sliding window", True)):
            directory = Path(root) / name.replace(" ", "-")
            build(directory, args.window, sliding, 2 * (args.tokens + GENERATED))
            figures[name] = run(directory, args.tokens, args.chunk)
            last, peak, seconds = figures[name]
            print(
                f"{name:>15}: {last} layer-blocks of {BLOCK} tokens held at "
                f"{args.tokens + GENERATED} tokens, peak {peak} ({seconds:.1f} s)"
            )
    full, sliding_ = figures["full attention"], figures["sliding window"]
    print(
        f"sliding / full: {sliding_[0] / full[0]:.3f} at the conversation's end, "
        f"{sliding_[1] / full[1]:.3f} at the peak (window {args.window}, chunks of {args.chunk})"
    )


if __name__ == "__main__":
    main()
