"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert, gpt-oss) on tiny
random-weight checkpoints built with transformers: logits equal transformers' in float32
through ragged, chunked and prefix-cached steps; the engine's greedy tokens equal
transformers' through chunked prefill, prefix hits and preemption, at TP=1 and TP=2 (a slice
of every expert per rank, or whole experts per rank); int8/int4 experts run through Folio's
quantized linears; routing variants Folio does not implement are refused naming the config
key; the CPU experts are one op inside compiled programs (no graph break), whose decode steps
give the eager engine's and transformers' greedy tokens; Folio's kernels around the CPU experts
(folio_moe's route and combine) give torch's ops' values bit for bit; Folio's stacked float32
experts kernel (folio_moe::experts) is a float64 loop over experts within float32 rounding (on
AMX tiles too, for bfloat16 weights, float32 or bfloat16 activations), and float32 layers use it
(bfloat16 ones where the CPU has AMX); and the model code imports no dynamo."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models import BASE, TOL, Runner, hf_logits, random_tokens
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.engine import LLMEngine
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.linear import Linear, describe_linears
from engine.layers.moe import SparseMoe, run_experts
from engine.layers.quantization import QuantizedWeight, quantize
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.mxfp4 import dequantize_mxfp4
from tiny_models import MOE_VARIANTS, hf_greedy, make_checkpoint


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = make_checkpoint(directory, *MOE_VARIANTS[request.param])
    return request.param, directory, reference


def test_logits_match_transformers_through_chunks_and_prefix_hits(variant):
    name, directory, reference = variant
    model, config = load_model(directory, torch.float32, "cpu")
    layers = model.model.layers
    assert isinstance(layers[0].mlp, SparseMoe)
    assert isinstance(layers[1].mlp, SparseMoe) == (name != "qwen3-moe")  # its dense layer
    runner = Runner(model, config)
    a, b = random_tokens(13, 1), random_tokens(5, 2)
    first_a, first_b = runner.step([("a", a[:6]), ("b", b)])
    (rest_a,) = runner.step([("a", a[6:])])  # chunked prefill
    torch.testing.assert_close(torch.cat((first_a, rest_a)), hf_logits(reference, a), **TOL)
    torch.testing.assert_close(first_b, hf_logits(reference, b), **TOL)
    # c shares a's first two blocks and extends them while b decodes.
    runner.share_prefix("a", "c", 8)
    c = a[:8] + random_tokens(6, 3)
    b.append(int(first_b[-1].argmax()))
    b_next, c_logits = runner.step([("b", b[-1:]), ("c", c[8:])])
    torch.testing.assert_close(b_next[0], hf_logits(reference, b)[-1], **TOL)
    torch.testing.assert_close(c_logits, hf_logits(reference, c)[8:], **TOL)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = 32
FIRST_WAVE = {f"a{i}": prompt(SHARED + 6 * i, i) for i in range(4)}
SECOND_WAVE = {"b0": FIRST_WAVE["a0"][:SHARED] + prompt(7, 50)}


def engine_tokens(
    directory, tp: int, expert_parallel: bool = False, compiled: bool = False
) -> tuple[dict[str, list[int]], object, dict[str, list[int]], Counter[int]]:
    """Both waves' greedy tokens: prompts prefilled in chunks of 16, too few blocks for the
    first wave at once (preemption), the second wave starting from the first's cached blocks.
    Also rank 0's experts of layer 0 (expert number -> its gate and up rows), and with
    `compiled` (decode steps through compiled programs), the decode steps they ran, by rows."""
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            dtype="float32",
            block_size=16,
            num_kv_blocks=8,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            tensor_parallel_size=tp,
            enable_expert_parallel=expert_parallel,
            enforce_eager=not compiled,
            decode_compile="startup",
        )
    )
    tokens: dict[str, list[int]] = {}
    moe = engine.executor.runner.model.model.layers[0].mlp
    held = {number: expert.gate_up_proj.output_sizes for number, expert in moe.experts.items()}
    try:
        for wave in (FIRST_WAVE, SECOND_WAVE):
            for request_id, ids in wave.items():
                engine.add_request(request_id, ids, GREEDY)
            while engine.has_unfinished:
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        programs = engine.executor.runner.compiled_decode
        return tokens, engine.stats(), held, Counter(programs.rows_run if programs else {})
    finally:
        engine.close()


def expected_tokens(reference) -> dict[str, list[int]]:
    return {
        request_id: hf_greedy(reference, ids, GREEDY.max_tokens)
        for wave in (FIRST_WAVE, SECOND_WAVE)
        for request_id, ids in wave.items()
    }


# gpt-oss's sliding layers free their blocks behind a window of 3: test_sliding_window runs its
# engine, with blocks and a pool sized for windows.
@pytest.mark.parametrize("variant", [v for v in MOE_VARIANTS if v != "gpt-oss"], indirect=True)
def test_engine_greedy_tokens_match_transformers(variant):
    _, directory, reference = variant
    got, stats, _, _ = engine_tokens(directory, 1)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == expected_tokens(reference)


# TP=2 on one family: the experts' sharding is the same code for both. Each rank holds a slice
# of every expert, or with expert parallelism whole experts (4 of the 8 each).
@pytest.mark.parametrize("variant", ["mixtral"], indirect=True)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
def test_two_ranks_share_the_experts(variant, expert_parallel):
    _, directory, reference = variant
    got, stats, held, _ = engine_tokens(directory, 2, expert_parallel)
    if expert_parallel:
        assert held == {str(e): [96, 96] for e in range(4)}
    else:
        assert held == {str(e): [48, 48] for e in range(8)}
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == expected_tokens(reference)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_run_through_folio_linears(tmp_path, method):
    """Each expert's projections are quantized like any other linear and the router is not: the
    logits are transformers' on the same model with every linear replaced by its quantized
    values (the vocabulary projection in int8): within float32 summation order for int8, whose
    kernel multiplies float32 activations rounded to 16 bits; for int4, whose kernel rounds them
    to 8 bits per block of 32 (GGUF's Q8_1), within that rounding."""
    reference = make_checkpoint(tmp_path, *MOE_VARIANTS["mixtral"])
    model, config = load_model(tmp_path, torch.float32, "cpu", quantization=method)
    moe = model.model.layers[0].mlp
    assert isinstance(moe.experts["7"].gate_up_proj.packed, QuantizedWeight)
    assert isinstance(moe.experts["7"].down_proj.packed, QuantizedWeight)
    with torch.no_grad():
        for name, weight in reference.named_parameters():
            if weight.dim() < 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                continue  # the embedding, norms and router stay as they are
            rows = weight.view(-1, weight.shape[-1])  # an expert's rows, for stacked experts
            grid = quantize(rows, "int8" if "lm_head" in name else method, folio_kernels=False)
            weight.copy_(grid.dequantized(torch.float32).view_as(weight))
    tokens = random_tokens(9, 4)
    (logits,) = Runner(model, config).step([("a", tokens)])
    bound = 2e-3 if method == "int8" else 0.15
    torch.testing.assert_close(logits, hf_logits(reference, tokens), atol=bound, rtol=0.0)


MIXTRAL_CONFIG = dict(
    BASE,
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)


def test_moe_config_shapes_and_refusals(tmp_path):
    mixtral = ModelConfig.from_dict(MIXTRAL_CONFIG).moe
    assert mixtral is not None and mixtral.renormalize and mixtral.intermediate_size == 16
    assert mixtral.sparse(0) and mixtral.sparse(1)
    qwen = ModelConfig.from_dict(
        dict(
            MIXTRAL_CONFIG,
            architectures=["Qwen3MoeForCausalLM"],
            num_hidden_layers=4,
            num_experts=4,
            num_local_experts=None,
            moe_intermediate_size=6,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    ).moe
    assert qwen is not None and not qwen.renormalize and qwen.intermediate_size == 6
    assert [qwen.sparse(i) for i in range(4)] == [False, True, False, False]
    dense = dict(MIXTRAL_CONFIG, architectures=["LlamaForCausalLM"])
    assert ModelConfig.from_dict(dense).moe is None

    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        with pytest.raises(ValueError, match=rf"unsupported MoE routing {key}='{value}'"):
            ModelConfig.from_dict(dict(MIXTRAL_CONFIG, **{key: value}))
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh' for a mixture of"):
        ModelConfig.from_dict(dict(MIXTRAL_CONFIG, hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and the 4"):
        ModelConfig.from_dict(dict(MIXTRAL_CONFIG, num_experts_per_tok=5))
    # Refused at start-up, before any weight is read.
    make_checkpoint(tmp_path, *MOE_VARIANTS["mixtral"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, scoring_func="sigmoid")))
    with pytest.raises(ValueError, match="scoring_func"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32"))


def test_model_code_imports_no_dynamo():
    """The CPU path's op and its compiled-or-eager switch load no dynamo: importing the model
    code, as every engine start does, stays fast (a fresh interpreter: this module's own imports
    load it)."""
    code = textwrap.dedent(
        """
        import sys
        import engine.engine, engine.models.loader, engine.layers.moe
        assert "torch._dynamo" not in sys.modules, "importing the model code loaded dynamo"
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "dtype, quantization",
    [
        (torch.float32, None),
        (torch.float32, "int8"),
        (torch.float32, "int4"),
        (torch.bfloat16, None),
        (torch.bfloat16, "int4"),  # torch's int4 kernel
    ],
    ids=["float32", "int8", "int4", "bfloat16", "bfloat16-int4"],
)
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt-oss"])
def test_cpu_experts_are_one_op_in_a_compiled_graph(dtype, quantization, gpt_oss):
    """The CPU path as dynamo traces it: one graph (the experts are folio::moe_experts, which
    rebuilds each expert's linears from the weights it is given), whose output is the eager
    block's, for every weight form a CPU gives them (oneDNN-packed, bfloat16 tiles or plain,
    int8 and int4 on Folio's kernels or torch's), with gpt-oss's biases and clamped SwiGLU too."""
    torch.manual_seed(0)
    swiglu = (1.702, 1.0) if gpt_oss else None
    block = SparseMoe(
        64,
        4,
        2,
        32,
        True,
        TorchAttentionBackend(),
        dtype,
        "cpu",
        biases=gpt_oss,
        clamped_swiglu=swiglu,
    )
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.3)
    block.finalize_weights()
    for module in block.modules():
        if isinstance(module, Linear):
            module.finalize_weights(quantization)
    x = torch.randn(7, 64, dtype=dtype)
    with torch.inference_mode():
        # fullgraph: a graph break fails the trace. From a clean slate: each case compiles
        # the same forward again, and dynamo stops recompiling a code object after 8 times.
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("first, local", [(0, 8), (2, 3), (6, 2)], ids=["all", "middle", "last"])
@pytest.mark.parametrize("threads", [1, 2])
def test_folio_moe_kernels_give_torch_ops_values(dtype, first, local, threads):
    """run_experts through folio_moe's route and combine gives what torch's ops give, bit for
    bit (the same roundings, a token's experts added in expert order), at any thread count,
    whichever experts are this rank's (some tokens reaching none of them), and both are the
    loop over experts in float64 within the dtype's rounding; the route is a stable sort."""
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    generator = torch.Generator().manual_seed(first * 10 + local)
    tokens, hidden, k = 37, 136, 2
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    probs = torch.randn(tokens, 8, generator=generator).softmax(-1)
    weights, ids = torch.topk(probs, k)
    weights /= weights.sum(-1, keepdim=True)
    experts = [torch.randn(hidden, hidden, generator=generator) / 12 for _ in range(local)]

    def expert(e: int):
        return lambda rows: (rows.double() @ experts[e].double().T).to(dtype)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run_experts(x, weights, ids, first, local, expert, folio_kernels=True)
        counts, pairs, rows = torch.ops.folio_moe.route(x, ids, first, local)
    finally:
        torch.set_num_threads(before)
    expected = run_experts(x, weights, ids, first, local, expert, folio_kernels=False)
    assert got.dtype == dtype and torch.equal(got, expected)
    flat = ids.flatten()
    mine = (flat >= first) & (flat < first + local)
    assert counts.tolist() == torch.bincount(flat[mine] - first, minlength=local).tolist()
    order = flat.argsort(stable=True)
    assert torch.equal(pairs, order[mine[order]])
    assert torch.equal(rows, x[pairs // k])
    reference = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for slot in range(k):
            e = int(ids[t, slot]) - first
            if 0 <= e < local:
                w = float(weights[t, slot])
                reference[t] += w * (x[t].double() @ experts[e].double().T)
    bound = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), reference, atol=bound, rtol=bound)


def test_folio_moe_kernels_refuse_bad_inputs():
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    weights = torch.full((3, 2), 0.5)
    with pytest.raises(RuntimeError, match="ids must be the router's"):
        torch.ops.folio_moe.route(x, ids.int(), 0, 3)
    with pytest.raises(RuntimeError, match="ids has 2 rows, x 3"):
        torch.ops.folio_moe.route(x, ids[:2], 0, 3)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        torch.ops.folio_moe.route(x.double(), ids, 0, 3)
    _, pairs, rows = torch.ops.folio_moe.route(x, ids, 0, 3)
    with pytest.raises(RuntimeError, match="5 output rows for 6 pairs"):
        torch.ops.folio_moe.combine([rows[:5]], pairs, weights, 3)
    with pytest.raises(RuntimeError, match="weights must be the router's"):
        torch.ops.folio_moe.combine([rows], pairs, weights.double(), 3)
    with pytest.raises(RuntimeError, match="every output must be"):
        torch.ops.folio_moe.combine([rows[:3], rows[3:].bfloat16()], pairs, weights, 3)
    with pytest.raises(RuntimeError, match="pair 7 outside"):
        torch.ops.folio_moe.combine([rows], pairs + 2, weights, 3)


def expert_loop_float64(x, weights, ids, w13, w2, first):
    """The gated-SiLU experts' step in float64, token by token: the stacked kernel's oracle."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - first
            if 0 <= e < w13.shape[0]:
                gate_up = w13[e].double() @ x[t].double()
                h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
                out[t] += float(weights[t, slot]) * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize(
    "tokens, hidden, inter, first, local",
    [(64, 64, 48, 0, 8), (37, 37, 23, 2, 3), (1, 40, 16, 0, 8), (20, 70, 35, 6, 2)],
    ids=["multiples", "odd-sizes-middle", "one-token", "odd-sizes-last"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_stacked_experts_kernel_matches_float64_loop(tokens, hidden, inter, first, local, threads):
    """folio_moe::experts (route, every expert's gate_up and down over its packed panels,
    combine) is the float64 loop over experts within float32 rounding: uneven counts, experts
    no token reaches, sizes that are not multiples of the 16-column panels, this rank's share of
    the experts, any thread count; its AVX-512 and AVX2 code give the same bits."""
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    generator = torch.Generator().manual_seed(tokens + hidden)
    k = 2
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(8, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(8, hidden, inter, generator=generator) * inter**-0.5
    # Skewed routing: experts 0 and 2 (and whichever a token's second pick is) take most
    # tokens, expert 7 none unless chosen second; a few tokens leave this rank's experts.
    logits = torch.randn(tokens, 8, generator=generator)
    logits[:, 0] += 2.0
    logits[: tokens // 2, 2] += 3.0
    logits[:, 7] -= 10.0
    weights, ids = torch.topk(logits.softmax(-1), k)
    gate_up, down = torch.ops.folio_moe.pack_experts(
        list(w13[first : first + local]), list(w2[first : first + local])
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide, narrow = (
            torch.ops.folio_moe.experts(x, weights, ids, gate_up, down, first, avx512)
            for avx512 in (True, False)
        )
    finally:
        torch.set_num_threads(before)
    expected = expert_loop_float64(
        x, weights, ids, w13[first : first + local], w2[first : first + local], first
    )
    mine = ((ids >= first) & (ids < first + local)).any(-1)
    assert not bool(wide[~mine].any()), "a token none of this rank's experts reached"
    torch.testing.assert_close(wide.double(), expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(wide, narrow)


def test_stacked_experts_kernel_refuses_bad_inputs():
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    w13, w2 = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    with pytest.raises(RuntimeError, match="must be all float32 or all bfloat16"):
        torch.ops.folio_moe.pack_experts(list(w13.double()), list(w2.double()))
    with pytest.raises(RuntimeError, match="must be all float32 or all bfloat16"):
        torch.ops.folio_moe.pack_experts(list(w13), list(w2.bfloat16()))
    with pytest.raises(RuntimeError, match="expert 1 has gate_up"):
        torch.ops.folio_moe.pack_experts([w13[0], w13[1, :4]], list(w2))
    gate_up, down = torch.ops.folio_moe.pack_experts(list(w13), list(w2))
    x, ids, weights = torch.randn(3, 8), torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.ones(3, 2)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        torch.ops.folio_moe.experts(x.half(), weights, ids, gate_up, down, 0, True)
    with pytest.raises(RuntimeError, match="do not fit 7 features"):
        torch.ops.folio_moe.experts(x[:, :7], weights, ids, gate_up, down, 0, True)


def test_stacked_experts_kernel_bfloat16_panels_and_activations():
    """bfloat16 panels give exactly the float32 panels' results for the same values (widened
    exactly as they are loaded), in both instruction sets' code; bfloat16 activations give the
    float64 loop within bfloat16 rounding, as bfloat16."""
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    generator = torch.Generator().manual_seed(5)
    tokens, hidden, inter, k = 29, 40, 24, 2
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = (torch.randn(6, 2 * inter, hidden, generator=generator) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(6, hidden, inter, generator=generator) * inter**-0.5).bfloat16()
    weights, ids = torch.topk(torch.randn(tokens, 6, generator=generator).softmax(-1), k)
    halves = torch.ops.folio_moe.pack_experts(list(w13), list(w2))
    full = torch.ops.folio_moe.pack_experts(list(w13.float()), list(w2.float()))
    assert halves[0].dtype == torch.bfloat16 and full[0].dtype == torch.float32
    results = [
        torch.ops.folio_moe.experts(x, weights, ids, *packed, 0, avx512)
        for packed in (halves, full)
        for avx512 in (True, False)
    ]
    assert all(torch.equal(results[0], r) for r in results[1:])
    got = torch.ops.folio_moe.experts(x.bfloat16(), weights, ids, *halves, 0, True)
    expected = expert_loop_float64(x.bfloat16(), weights, ids, w13, w2, 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=2e-2)


def amx_usable() -> bool:
    return cpu_capabilities().folio_kernels and bool(torch.ops.folio_moe.amx_usable())


def bf16_pairs_usable() -> bool:
    """Whether bfloat16 activations run over weights packed in pairs: on AMX, or with AVX-512
    BF16's dot products."""
    return amx_usable() or cpu_capabilities().avx512_bf16


@pytest.mark.parametrize("first, local", [(0, 6), (2, 3)], ids=["all-experts", "rank-share"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_stacked_experts_in_pairs_match_float64_loop(dtype, first, local, threads):
    """Panels packed in pairs: float32 activations over bfloat16 weights (a bfloat16 checkpoint
    served in float32: on AMX, the activations split into three bfloat16 parts) are the float64
    loop within float32 rounding, bfloat16 ones (on AMX, or AVX-512 BF16's dot products) within
    bfloat16 rounding, with experts of more than 16 rows (several row tiles and blocks), experts
    no token reaches and this rank's share of the experts, at any thread count."""
    if dtype == torch.float32 and not amx_usable():
        pytest.skip("this CPU has no AMX (or Linux did not grant it)")
    if not bf16_pairs_usable():
        pytest.skip("this CPU has neither AMX nor AVX-512 BF16")
    generator = torch.Generator().manual_seed(7 + first)
    tokens, hidden, inter, k = 45, 64, 96, 2
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(6, 2 * inter, hidden, generator=generator) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(6, hidden, inter, generator=generator) * inter**-0.5).bfloat16()
    logits = torch.randn(tokens, 6, generator=generator)
    logits[:, 2] += 3.0  # expert 2 takes most tokens: more than one tile of rows
    logits[:, 4] -= 10.0  # expert 4 none unless chosen second
    weights, ids = torch.topk(logits.softmax(-1), k)
    w13, w2 = w13[first : first + local], w2[first : first + local]
    pairs = torch.ops.folio_moe.pack_experts(list(w13), list(w2), True)
    assert pairs[0].shape == (local, inter // 16, hidden // 2, 64)
    assert pairs[1].shape == (local, hidden // 16, inter // 2, 32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.folio_moe.experts(x, weights, ids, *pairs, first, True)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == dtype
    mine = ((ids >= first) & (ids < first + local)).any(-1)
    assert not bool(got[~mine].any())
    expected = expert_loop_float64(x, weights, ids, w13, w2, first)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_stacked_experts_on_amx_few_float32_rows_give_the_avx512_bits(threads):
    """An expert's block of at most 8 float32 rows (a decode step's) goes through FMAs over the
    pairs, not the tiles: the AVX-512 code's sums on widened bfloat16 panels, bit for bit."""
    if not amx_usable():
        pytest.skip("this CPU has no AMX (or Linux did not grant it)")
    generator = torch.Generator().manual_seed(3)
    hidden, inter = 64, 96
    w13 = (torch.randn(4, 2 * inter, hidden, generator=generator) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(4, hidden, inter, generator=generator) * inter**-0.5).bfloat16()
    pairs = torch.ops.folio_moe.pack_experts(list(w13), list(w2), True)
    widened = torch.ops.folio_moe.pack_experts(list(w13), list(w2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # One token (two experts, a row each); 2 or 4 rows for every expert; 8, 2 and 6 rows.
        eight = [[0, 1]] * 2 + [[0, 2]] * 6
        for ids in ([[2, 0]], [[0, 1], [2, 3], [0, 1], [2, 1], [3, 2], [1, 2]], eight):
            ids = torch.tensor(ids)
            x = torch.randn(len(ids), hidden, generator=generator)
            weights = torch.rand(len(ids), 2, generator=generator)
            got = torch.ops.folio_moe.experts(x, weights, ids, *pairs, 0, True)
            expected = torch.ops.folio_moe.experts(x, weights, ids, *widened, 0, True)
            assert torch.equal(got, expected)
    finally:
        torch.set_num_threads(before)


def test_stacked_experts_pairs_refuse_what_they_cannot_hold():
    assert cpu_capabilities().folio_kernels, "Folio's CPU kernels did not load"
    w13, w2 = torch.randn(2, 64, 32).bfloat16(), torch.randn(2, 32, 32).bfloat16()
    with pytest.raises(RuntimeError, match="pairs need bfloat16 weights and sizes"):
        torch.ops.folio_moe.pack_experts(list(w13.float()), list(w2.float()), True)
    with pytest.raises(RuntimeError, match="pairs need bfloat16 weights and sizes"):
        torch.ops.folio_moe.pack_experts(list(w13[:, :, :16]), list(w2[:, :16]), True)
    pairs = torch.ops.folio_moe.pack_experts(list(w13), list(w2), True)
    x, ids, weights = torch.randn(3, 32), torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.ones(3, 2)
    for activations in (x, x.bfloat16()):  # AVX-512 not allowed: neither AMX nor its BF16
        with pytest.raises(RuntimeError, match="packed in pairs need AMX, or bfloat16"):
            torch.ops.folio_moe.experts(activations, weights, ids, *pairs, 0, False)
    if not amx_usable():  # float32 activations over pairs need AMX's tiles
        with pytest.raises(RuntimeError, match="packed in pairs need AMX, or bfloat16"):
            torch.ops.folio_moe.experts(x, weights, ids, *pairs, 0, True)


def bf16_valued_block(
    dtype: torch.dtype,
    hidden: int = 64,
    inter: int = 32,
    scale: float = 0.15,
    stack: bool = True,
    pairs: bool = True,
) -> SparseMoe:
    """A SiLU layer of 4 experts, top-2, every weight a bfloat16 value (small enough that
    bfloat16 rounds its outputs well inside the tests' tolerance), finalized as the loader
    leaves it."""
    torch.manual_seed(0)
    layer = SparseMoe(hidden, 4, 2, inter, True, TorchAttentionBackend(), dtype, "cpu")
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape).mul(scale).bfloat16())
    layer.finalize_weights(stack_cpu_experts=stack, cpu_pairs=pairs)
    for module in layer.modules():
        if isinstance(module, Linear):
            module.finalize_weights()
    return layer


def test_layer_runs_bfloat16_experts_on_amx(monkeypatch, caplog):
    """On a CPU with AMX, bfloat16 layers and float32 ones holding bfloat16 values (sizes
    multiples of 32) pack their experts in AMX's pairs and give the experts one at a time
    within bfloat16 (float32) rounding; with `cpu_pairs` off they pack as before (bfloat16 ones
    then run one at a time on CPUs with Folio's tiles); where asking for AMX fails, one
    warning, and the same layer packs without it."""
    from engine.layers import moe

    block = bf16_valued_block
    if not amx_usable():
        pytest.skip("this CPU has no AMX (or Linux did not grant it)")
    x = torch.randn(21, 64)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        layer = block(dtype)
        assert layer.stacked is not None and layer.stacked.gate_up is not None
        assert layer.stacked.gate_up.shape[-1] == 64  # AMX's pairs
        with torch.inference_mode():
            got = layer(x.to(dtype))
            assert got.dtype == dtype
            torch.testing.assert_close(
                got, block(dtype, stack=False)(x.to(dtype)), atol=tolerance, rtol=tolerance
            )
    float32 = block(torch.float32, pairs=False)
    assert float32.stacked is not None and float32.stacked.gate_up is not None
    assert float32.stacked.gate_up.shape[-1] == 32
    assert (block(torch.bfloat16, pairs=False).stacked is None) == cpu_capabilities().bf16_tiles

    def refused() -> bool:
        raise RuntimeError("no tiles today")

    moe._amx_usable.cache_clear()
    monkeypatch.setattr(torch.ops.folio_moe, "amx_usable", refused)
    try:
        with caplog.at_level("WARNING", logger=moe.logger.name):
            layers = [block(torch.float32), block(torch.float32)]
        assert all(
            layer.stacked is not None
            and layer.stacked.gate_up is not None
            and layer.stacked.gate_up.shape[-1] == 32
            for layer in layers
        )
        warnings = [r for r in caplog.records if "AMX for the stacked CPU experts" in r.message]
        assert len(warnings) == 1 and "no tiles today" in warnings[0].message
    finally:
        moe._amx_usable.cache_clear()


def test_layer_runs_bfloat16_experts_in_pairs_on_avx512_bf16():
    """On a CPU with AVX-512 BF16 and no AMX, a bfloat16 layer whose sizes are multiples of 32
    packs its experts in pairs for AVX-512 BF16's dot products (experts of more than 12 rows
    included: several blocks) and gives the experts one at a time on Folio's tiles within
    bfloat16 rounding; a float32 layer over bfloat16 values keeps its widened panels; with
    `cpu_pairs` off, or sizes that are not multiples of 32, bfloat16 experts run one at a time
    on the tiles, as before."""
    if not cpu_capabilities().avx512_bf16:
        pytest.skip("this CPU has no AVX-512 BF16")
    if amx_usable():
        pytest.skip("this CPU runs bfloat16 pairs on AMX (test_layer_runs_bfloat16_experts_on_amx)")
    block = bf16_valued_block
    layer = block(torch.bfloat16)
    assert layer.stacked is not None and layer.stacked.gate_up is not None
    assert layer.stacked.gate_up.shape[-1] == 64  # pairs
    x = torch.randn(40, 64).bfloat16()  # 80 (token, expert) pairs over 4 experts
    with torch.inference_mode():
        got = layer(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, block(torch.bfloat16, stack=False)(x), atol=2e-2, rtol=2e-2)
    float32 = block(torch.float32)
    assert float32.stacked is not None and float32.stacked.gate_up is not None
    assert float32.stacked.gate_up.shape[-1] == 32
    assert block(torch.bfloat16, pairs=False).stacked is None
    assert block(torch.bfloat16, hidden=40, inter=24).stacked is None


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_layer_stacks_float32_cpu_experts(quantization):
    """A float32 SiLU layer on the CPU packs its experts for folio_moe::experts (their linears
    then hold no second copy) and gives the per-expert linears' output within float32
    rounding; quantized, the stack is released and the experts run through the quantized
    linears."""
    torch.manual_seed(0)
    blocks = []
    for stack in (True, False):
        torch.manual_seed(0)
        block = SparseMoe(40, 4, 2, 24, True, TorchAttentionBackend(), torch.float32, "cpu")
        with torch.no_grad():
            for parameter in block.parameters():
                parameter.normal_(0.0, 0.3)
        block.finalize_weights(stack_cpu_experts=stack)
        for module in block.modules():
            if isinstance(module, Linear):
                module.finalize_weights(quantization)
        blocks.append(block)
    stacked, per_expert = blocks
    assert stacked.stacked is not None and per_expert.stacked is None
    expert = stacked._expert_list[0]
    if quantization is None:
        assert stacked.stacked.gate_up is not None
        assert expert.gate_up_proj.weight.numel() == 0 and expert.down_proj.weight.numel() == 0
        assert "8 experts stacked (Folio)" in describe_linears(stacked)  # the load log's words
    else:
        assert stacked.stacked.gate_up is None
        assert isinstance(expert.gate_up_proj.packed, QuantizedWeight)
        assert "stacked" not in describe_linears(stacked)
    x = torch.randn(9, 40)
    with torch.inference_mode():
        torch.testing.assert_close(stacked(x), per_expert(x), atol=1e-5, rtol=1e-5)


def test_layer_stacks_bfloat16_values_in_half_the_bytes(monkeypatch):
    """A float32 layer whose weights all hold bfloat16 values packs bfloat16 panels; a bfloat16
    layer whose sizes are not multiples of 32 (no pairs) runs stacked only where the CPU has no
    bfloat16 tiles (as on an AVX2 CPU, here pretended), its output the per-expert linears'
    within bfloat16 rounding."""
    import dataclasses

    from engine.layers import moe

    def block(dtype: torch.dtype, stack: bool = True) -> SparseMoe:
        return bf16_valued_block(dtype, hidden=40, inter=24, scale=0.3, stack=stack)

    x = torch.randn(9, 40)
    float32 = block(torch.float32)
    assert float32.stacked is not None and float32.stacked.gate_up is not None
    assert float32.stacked.gate_up.dtype == torch.bfloat16
    with torch.inference_mode():
        torch.testing.assert_close(
            float32(x), block(torch.float32, stack=False)(x), atol=1e-5, rtol=1e-5
        )
    assert (block(torch.bfloat16).stacked is None) == cpu_capabilities().bf16_tiles
    no_tiles = dataclasses.replace(cpu_capabilities(), avx512_bf16=False)
    monkeypatch.setattr(moe, "cpu_capabilities", lambda: no_tiles)
    bfloat16 = block(torch.bfloat16)
    assert bfloat16.stacked is not None and bfloat16.stacked.gate_up is not None
    with torch.inference_mode():
        got = bfloat16(x.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(
            got, block(torch.bfloat16, stack=False)(x.bfloat16()), atol=3e-2, rtol=2e-2
        )


@pytest.mark.parametrize("variant", ["mixtral"], indirect=True)
def test_compiled_decode_steps_give_eager_and_transformers_tokens(variant):
    """Decode steps through programs compiled whole (torch.compile's fullgraph: a graph break
    would fail the build and leave the engine decoding eagerly) give the eager engine's greedy
    tokens, which are transformers', through chunked prefill, prefix hits and preemption."""
    _, directory, reference = variant
    got, stats, _, rows_run = engine_tokens(directory, 1, compiled=True)
    assert rows_run and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    eager, _, _, _ = engine_tokens(directory, 1)
    assert got == eager == expected_tokens(reference)


def random_mxfp4(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks [*shape, 16] of random codes and scales [*shape] of exponents 2**-5 .. 2**-3
    (weights up to 0.75, as large as the other random weights)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(122, 125, shape, generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    blocks, scales = random_mxfp4(3, 5, 2, seed=0)  # 3 experts, 5 rows, 64 columns
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(got, expected.transpose(1, 2))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), got)  # exact
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(3, 5, 2, 16\) do not match scales"):
        dequantize_mxfp4(blocks, scales[:, :, :1], torch.float32)


def test_gpt_oss_mxfp4_experts_load_dequantized(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 (*_blocks and *_scales, as OpenAI's are):
    logits equal transformers' on the same model with the experts set to the
    reference dequantization (transformers' own)."""
    reference = make_checkpoint(tmp_path, *MOE_VARIANTS["gpt-oss"])
    config = reference.config
    hidden, inter, experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        module = reference.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            blocks, scales = random_mxfp4(experts, rows, cols // 32, seed=layer)
            del tensors[prefix + name]
            tensors[f"{prefix}{name}_blocks"], tensors[f"{prefix}{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(module, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    save_file(tensors, tmp_path / "model.safetensors")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))

    model, model_config = load_model(tmp_path, torch.float32, "cpu")
    tokens = random_tokens(11, 5)
    (logits,) = Runner(model, model_config).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(reference, tokens), **TOL)
