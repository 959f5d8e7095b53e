"""Compiles every kernel ahead of time for sm_80 and sm_90 in fp16 and bf16, for no GPU.

Run as a script in a process WITHOUT TRITON_INTERPRET (the kernels must be real JIT functions);
prints one JSON line per (kernel, target, dtype) with the size of the cubin. It catches what the
interpreter accepts but the compiler refuses (types, shapes of tl.dot, control flow).
"""

from __future__ import annotations

import json
import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without the Triton interpreter"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from engine.kernels.triton.activation import silu_and_mul_kernel  # noqa: E402
from engine.kernels.triton.fused_moe import fused_moe_kernel  # noqa: E402
from engine.kernels.triton.kv_cache import write_kv_kernel  # noqa: E402
from engine.kernels.triton.lora import lora_segment_kernel  # noqa: E402
from engine.kernels.triton.paged_attention import paged_attention_kernel  # noqa: E402
from engine.kernels.triton.rms_norm import rms_norm_kernel  # noqa: E402
from engine.kernels.triton.rotary import rotary_kernel  # noqa: E402
from engine.kernels.triton.sampling import sample_kernel, uniform_noise_kernel  # noqa: E402


def attention(
    dtype: str,
    decode: bool,
    group: int,
    group_p: int,
    block_m: int,
    head_dim: int,
    sinks: bool = False,
):
    args = dict(
        q_ptr=f"*{dtype}",
        out_ptr=f"*{dtype}",
        cache_ptr=f"*{dtype}",
        block_tables_ptr="*i32",
        seq_lens_ptr="*i32",
        query_start_ptr="*i32",
        scale_log2="fp32",
        q_stride_t="i32",
        q_stride_h="i32",
        out_stride_t="i32",
        out_stride_h="i32",
        table_stride="i32",
        v_offset="i64",
        window="i32",
        sinks_ptr=f"*{dtype}",
    )
    constants = dict(
        NUM_KV_HEADS=3,
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim,
        BLOCK_SIZE=16,
        BLOCK_M=block_m,
        BLOCK_N=64,
        DOT_PRECISION="tf32",
        DECODE=decode,
        HAS_SINKS=sinks,
    )
    return paged_attention_kernel, args, constants


def cases(dtype: str):
    yield "decode_attention_gqa3_d64", attention(dtype, True, 3, 16, 1, 64)
    yield "prefill_attention_gqa3_d64", attention(dtype, False, 3, 4, 16, 64)
    yield "prefill_attention_gqa4_d128", attention(dtype, False, 4, 4, 16, 128)
    yield "prefill_attention_sinks_gqa8_d64", attention(dtype, False, 8, 8, 8, 64, sinks=True)
    yield (
        "write_kv",
        (
            write_kv_kernel,
            dict(
                k_ptr=f"*{dtype}",
                v_ptr=f"*{dtype}",
                cache_ptr=f"*{dtype}",
                slot_mapping_ptr="*i64",
                k_stride_t="i32",
                k_stride_h="i32",
                v_stride_t="i32",
                v_stride_h="i32",
                v_offset="i64",
            ),
            dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK=256),
        ),
    )
    yield (
        "rms_norm_residual",
        (
            rms_norm_kernel,
            dict(
                x_ptr=f"*{dtype}",
                residual_ptr=f"*{dtype}",
                weight_ptr=f"*{dtype}",
                out_ptr=f"*{dtype}",
                x_stride="i32",
                residual_stride="i32",
                out_stride="i32",
                eps="fp32",
            ),
            dict(SIZE=576, BLOCK=1024, HAS_RESIDUAL=True),
        ),
    )
    yield (
        "rotary",
        (
            rotary_kernel,
            dict(
                q_ptr=f"*{dtype}",
                k_ptr=f"*{dtype}",
                positions_ptr="*i64",
                table_ptr=f"*{dtype}",
                q_stride_t="i32",
                q_stride_h="i32",
                k_stride_t="i32",
                k_stride_h="i32",
                table_stride="i32",
            ),
            dict(
                NUM_Q_HEADS=9, NUM_Q_HEADS_P=16, NUM_K_HEADS=3, NUM_K_HEADS_P=4, HALF=32, HALF_P=32
            ),
        ),
    )
    yield (
        "silu_and_mul",
        (
            silu_and_mul_kernel,
            dict(
                x_ptr=f"*{dtype}",
                out_ptr=f"*{dtype}",
                x_stride="i32",
                out_stride="i32",
            ),
            dict(SIZE=1536, BLOCK=1024),
        ),
    )
    yield (
        "fused_moe_down",
        (
            fused_moe_kernel,
            dict(
                a_ptr=f"*{dtype}",
                w_ptr=f"*{dtype}",
                c_ptr=f"*{dtype}",
                bias_ptr=f"*{dtype}",
                weights_ptr="*fp32",
                sorted_pairs_ptr="*i32",
                block_expert_ptr="*i32",
                num_pairs="i32",
                n="i32",
                k="i32",
                a_stride="i32",
                w_stride_e="i32",
                w_stride_n="i32",
                c_stride="i32",
            ),
            dict(
                TOP_K=1,
                MUL_WEIGHT=True,
                HAS_BIAS=True,
                BLOCK_M=16,
                BLOCK_N=64,
                BLOCK_K=64,
                DOT_PRECISION="tf32",
            ),
        ),
    )
    # LoRA: shrink (stored into the narrow intermediate) and expand (added into the output).
    for name, add in (("lora_shrink", False), ("lora_expand", True)):
        yield (
            name,
            (
                lora_segment_kernel,
                dict(
                    x_ptr=f"*{dtype}",
                    w_ptr=f"*{dtype}",
                    out_ptr=f"*{dtype}",
                    rows_ptr="*i32",
                    segments_ptr="*i32",
                    n="i32",
                    k="i32",
                    x_stride="i32",
                    w_stride_s="i32",
                    w_stride_n="i32",
                    out_stride="i32",
                ),
                dict(ADD=add, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32"),
            ),
        )


def sampling_cases():
    # Logits are float32 whatever the model dtype.
    yield (
        "sample",
        (
            sample_kernel,
            dict(
                logits_ptr="*fp32",
                out_ptr="*i64",
                temperature_ptr="*fp32",
                top_k_ptr="*i32",
                top_p_ptr="*fp32",
                min_p_ptr="*fp32",
                seeds_ptr="*i64",
                logits_stride="i32",
                vocab="i32",
            ),
            dict(BLOCK_V=1024),
        ),
    )
    yield (
        "uniform_noise",
        (
            uniform_noise_kernel,
            dict(seeds_ptr="*i64", out_ptr="*fp32", vocab="i32"),
            dict(BLOCK_V=1024),
        ),
    )


def main() -> int:
    failed = 0
    for capability in (80, 90):
        target = GPUTarget("cuda", capability, 32)
        for dtype, items in (
            ("fp16", cases("fp16")),
            ("bf16", cases("bf16")),
            ("fp32", sampling_cases()),
        ):
            for name, (kernel, args, constants) in items:
                signature = {**args, **{key: "constexpr" for key in constants}}
                try:
                    src = triton.compiler.ASTSource(
                        fn=kernel, signature=signature, constexprs=constants
                    )
                    compiled = triton.compile(src, target=target)
                    result = dict(ok=True, cubin_bytes=len(compiled.asm["cubin"]))
                except Exception as exc:  # report every failure, not just the first
                    failed += 1
                    result = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
                print(
                    json.dumps(dict(kernel=name, sm=capability, dtype=dtype, **result)), flush=True
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
