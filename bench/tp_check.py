"""`python -m bench.tp_check`: tensor parallelism on this machine's devices, as a figure and a
verdict: a random-weight Llama with 8 heads and 4 KV heads (so that N = 2 or 4 fits; the
default model's 9 heads take only 1, 3 or 9) runs the same greedy workload with N ranks and
with one, in float32; prints both throughputs and whether the tokens agree (exit 1 if not).

On CUDA each rank takes a GPU and the ranks talk NCCL; on CPU, gloo. A check for
bench/gpu_check.sh, not a test: the suite's TP tests are tests/unit/engine/test_tensor_parallel.py.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time


def make_model(directory: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=1024,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)


def run(directory: str, args: argparse.Namespace, tp: int) -> tuple[list[list[int]], float]:
    from common.config import EngineConfig
    from common.sampling_params import SamplingParams
    from engine.engine import LLMEngine

    rng = random.Random(1)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = LLMEngine(
        EngineConfig(
            model=directory,
            dtype="float32",
            device=args.device,
            num_kv_blocks=1024,
            tensor_parallel_size=tp,
        )
    )
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        while engine.has_unfinished:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    return [tokens[str(i)] for i in range(len(prompts))], len(prompts) * args.max_tokens / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        make_model(directory)
        one, one_tps = run(directory, args, 1)
        many, many_tps = run(directory, args, args.tensor_parallel_size)
    n = args.tensor_parallel_size
    same = sum(a == b for a, b in zip(one, many, strict=True))
    print(f"tp=1  {one_tps:8.1f} output tok/s")
    print(f"tp={n}  {many_tps:8.1f} output tok/s  ({many_tps / one_tps:.2f}x)")
    print(f"greedy tokens identical for {same} of {len(one)} requests")
    return 0 if same == len(one) else 1


if __name__ == "__main__":
    sys.exit(main())
