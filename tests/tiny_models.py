"""Test helper: tiny random-weight checkpoints of every supported architecture, built in the
test process with transformers (no hub, no files shipped). Used by model, engine and kernel
tests; it must stay small enough that building one takes milliseconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    vocab_size=160,
    max_position_embeddings=256,
)
VARIANTS = {
    "llama": (LlamaConfig, dict(SMALL, num_attention_heads=4, num_key_value_heads=2)),
    # SmolLM2's GQA ratio 3 and tied embeddings, plus llama3 RoPE scaling with every band in use.
    "llama-gqa3-tied-llama3rope": (
        LlamaConfig,
        dict(
            SMALL,
            hidden_size=72,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=8,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
    ),
    "mistral": (
        MistralConfig,
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    ),
    "qwen2-bias-tied": (
        Qwen2Config,
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3-qknorm": (
        Qwen3Config,
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    ),
    # A Qwen2 with YaRN (its attention factor scales cos and sin).
    "qwen2-yarn": (
        Qwen2Config,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Sliding windows of 3 positions (blocks of 4 in the engine tests are wider): Mistral's on
    # every layer; Gemma 3's on local layers between global ones, with everything else Gemma
    # has (scaled embeddings, 1 + w norms around each block, GeLU-tanh, q/k norms, local and
    # global rope bases, query_pre_attn_scalar, final logit soft-capping).
    "mistral-window3": (
        MistralConfig,
        dict(SMALL, num_attention_heads=4, num_key_value_heads=2, sliding_window=3),
    ),
    # Qwen2's convention: layers from max_window_layers on slide (a full layer, then a sliding one).
    "qwen2-window3-from-layer1": (
        Qwen2Config,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
        ),
    ),
    "gemma3-window3": (
        Gemma3TextConfig,
        dict(
            SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=3,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            query_pre_attn_scalar=24,
            final_logit_softcapping=3.0,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
        ),
    ),
    # Phi-3's fused qkv_proj and gate_up_proj, with LongRoPE's short factors and attention
    # factor (the long factors start past the prompts here; engine's rope tests check them).
    "phi3-longrope": (
        Phi3Config,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            original_max_position_embeddings=64,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.5 * i for i in range(8)],
            ),
        ),
    ),
}

# Mixtures of experts, apart: the dense models' tests do not run on them.
MOE_VARIANTS = {
    # Mixtral: softmax over the top-k (renormalised), every layer sparse.
    "mixtral": (
        MixtralConfig,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
    # Qwen3-MoE: q/k norms, top-k of the softmax left as it is, layer 1 a dense MLP.
    "qwen3-moe": (
        Qwen3MoeConfig,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen2-MoE: q/k/v biases, renormalised top-k, a shared expert behind a sigmoid gate.
    "qwen2-moe-shared": (
        Qwen2MoeConfig,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, windows of 3 on every other layer, YaRN, and
    # experts with biases, a router taking the softmax of its top-k logits, and a SwiGLU clamped
    # at 1 (random weights reach past it).
    "gpt-oss": (
        GptOssConfig,
        dict(
            SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=3,
            swiglu_limit=1.0,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def make_checkpoint(directory, config_class, kwargs, seed=0):
    """A seeded random model saved as safetensors; returns the transformers model (float32,
    eager)."""
    torch.manual_seed(seed)
    config = config_class(**kwargs, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Larger than the default init so attention is peaked and every bias and norm matters.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def make_tiny_smollm2(
    directory: Path, default_model_dir: Path, max_position_embeddings: int = 4096
) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, special ids and tokenizer (copied from the
    prepared default model): a served stack on it starts in a moment. Returns `directory`."""
    make_checkpoint(
        directory,
        LlamaConfig,
        dict(
            SMALL,
            vocab_size=49152,  # SmolLM2's tokenizer
            max_position_embeddings=max_position_embeddings,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=1,
            eos_token_id=2,
        ),
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, directory / name)
    return directory


def hf_greedy(reference, tokens: list[int], steps: int) -> list[int]:
    """The `steps` greedy tokens transformers' model `reference` generates after `tokens`
    (full recompute each step: the plainest reference there is)."""
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens) :]
