"""Perplexity of a model served by the offline engine on a text, window by window: how much
accuracy a setting (a quantization, a dtype) costs, measured rather than assumed.

`python -m bench.perplexity [--quantization int8|int4] [--dtype D] [--kv-cache-dtype K]
[--scheme S] [FILE]` prints
the token count and perplexity; tests call `perplexity` directly. `--scheme llama.cpp` scores as
llama.cpp's `llama-perplexity -c 512` does, so the two can be compared on the same file. Measures
only: never changes a model.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from common.config import KV_CACHE_DTYPES
from common.sampling_params import SamplingParams
from engine.llm import LLM

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "perplexity_text.txt"


def token_logprobs(llm: LLM, token_ids: Sequence[int], window: int = 512) -> list[float]:
    """Each token's log-probability given the tokens before it in its window (windows do not
    overlap; the first token of each has no context and is not scored)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) > 1]
    logprobs: list[float] = []
    for result in llm.generate(windows, [params] * len(windows)):
        assert result.prompt_logprobs is not None
        logprobs.extend(entry[0] for entry in result.prompt_logprobs if entry is not None)
    return logprobs


def llama_cpp_token_logprobs(llm: LLM, token_ids: Sequence[int], n_ctx: int = 512) -> list[float]:
    """The log-probabilities llama.cpp's `llama-perplexity` scores: the text cut into whole chunks
    of `n_ctx` tokens (a shorter tail is dropped), each chunk's first token replaced by BOS where
    the tokenizer adds one, and only the tokens of each chunk's second half scored (the first
    half is context), each given the chunk's tokens before it."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    tokenizer = llm.tokenizer
    # The tokenizer adds BOS where encoding with special tokens puts one before the text's own.
    adds_bos = len(tokenizer.encode("a")) > len(tokenizer.encode("a", add_special_tokens=False))
    bos = tokenizer.bos_token_id if adds_bos else None
    chunks = []
    for start in range(0, len(token_ids) - n_ctx + 1, n_ctx):
        chunk = list(token_ids[start : start + n_ctx])
        if bos is not None:
            chunk[0] = bos
        chunks.append(chunk)
    first = n_ctx // 2
    logprobs: list[float] = []
    for result in llm.generate(chunks, [params] * len(chunks)):
        assert result.prompt_logprobs is not None
        logprobs.extend(entry[0] for entry in result.prompt_logprobs[first + 1 :] if entry)
    return logprobs


def perplexity(logprobs: Sequence[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=("int8", "int4"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument(
        "--scheme",
        default="windows",
        choices=("windows", "llama.cpp"),
        help="windows: every token in windows of 512; llama.cpp: llama-perplexity -c 512's",
    )
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    ids = llm.tokenizer.encode(args.file.read_text())
    score = llama_cpp_token_logprobs if args.scheme == "llama.cpp" else token_logprobs
    scores = score(llm, ids)
    print(
        f"{args.file.name}: {len(ids)} tokens, {len(scores)} scored ({args.scheme}), "
        f"quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype}, "
        f"perplexity {perplexity(scores):.4f}"
    )


if __name__ == "__main__":
    main()
