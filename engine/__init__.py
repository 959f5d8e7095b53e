"""Folio's engine library: token ids in, token ids out, continuous batching over a paged KV cache.

`from engine import LLM, SamplingParams` is the offline API.
"""

from common.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)
