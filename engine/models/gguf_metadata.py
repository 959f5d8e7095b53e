"""The model config of a GGUF file (llama.cpp's format), read from its metadata as a Hugging
Face config.json dict, for engine.models.config; engine.models.gguf reads the tensors. It never
imports torch (the engine loop reads model configs) and never reads a tensor's data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.gguf_file import is_gguf, read_gguf

# general.architecture -> the Hugging Face architecture whose model serves it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Gemma 3 as llama.cpp runs a file of it (it writes no key for these): every sixth layer
# global, the local layers' rope base 10000, attention scaled by the head size (27B's
# query_pre_attn_scalar, hidden / heads, is the one size where that differs).
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE = 6, 10000.0


def file_quantization(path: str | Path) -> str | None:
    """The quantization a model's files carry as they are: "int4" for a GGUF holding Q4_0, Q4_1
    or Q4_K tensors (served on Folio's int4 kernels, which take float32 activations), "int8" for
    one holding Q8_0 or Q6_K ones and none of those (Folio's grouped int8 kernel, float32 too),
    else None."""
    if not is_gguf(path):
        return None
    types = {tensor.tensor_type.name for tensor in read_gguf(path).tensors}
    if types & {"Q4_0", "Q4_1", "Q4_K"}:
        return "int4"
    return "int8" if types & {"Q8_0", "Q6_K"} else None


def gguf_layout(path: str | Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """The file's tensors' names, types and shapes (not their data): what programs compiled
    for its model depend on, with its config."""
    return [
        (t.name, t.tensor_type.name, tuple(int(n) for n in t.shape))
        for t in read_gguf(path).tensors
    ]


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The file's model config as a Hugging Face config.json dict (what ModelConfig reads)."""
    reader = read_gguf(path)
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF {str(path)!r}: general.architecture {arch!r} is not served; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    # Gemma 3's global layers scale linearly (4B and up); the other kinds are not read yet.
    linear = arch == "gemma3" and scaling == "linear"
    if (scaling != "none" and not linear) or "rope_freqs.weight" in names:
        raise ValueError(
            f"GGUF {str(path)!r}: RoPE scaling ({arch}.rope.scaling.type {scaling!r}"
            f"{', a rope_freqs tensor' if 'rope_freqs.weight' in names else ''}) is not read yet"
        )

    def key(name: str) -> Any:
        if f"{arch}.{name}" not in meta:
            raise ValueError(f"GGUF {str(path)!r} has no {arch}.{name}")
        return meta[f"{arch}.{name}"]

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    gemma3: dict[str, Any] = {}
    if arch == "gemma3":
        head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
        gemma3 = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": head_dim,
            "sliding_window": key("attention.sliding_window"),
            "sliding_window_pattern": meta.get(
                f"{arch}.attention.sliding_window_pattern", GEMMA3_PATTERN
            ),
            "rope_local_base_freq": meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_BASE),
            "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        }
        if linear:
            factor = key("rope.scaling.factor")
            gemma3["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return gemma3 | {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        # Qwen2 always has q/k/v biases; the others where the file holds them.
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
