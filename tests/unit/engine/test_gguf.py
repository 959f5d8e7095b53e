"""A GGUF file served as it is: GGUFs written here with gguf's writer from a tiny random Llama
(llama.cpp's tensor names and Q/K row permutation) give transformers' greedy tokens (F32), and
a quantized or half-precision one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16)
gives what the same weights in float32 give, Folio's dequantization equal to gguf's own; a tied
Q8_0 or Q6_K vocabulary is one grouped int8 copy, embedding and projection; fused layers mixing
Q4_K and Q6_K parts (llama.cpp's Q4_K_M) keep each part's grid on the integer kernels; a type
Folio does
not read is refused, naming it and the tensor; the default model's own GGUF holds the codes
(its tied Q8_0 vocabulary on the grouped int8 kernel) and gives the logits of its prepared
(converted) directory."""

from __future__ import annotations

import dataclasses
import weakref
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from test_sliding_window import GREEDY, greedy

import engine.layers.quantization as quantization
from common import default_model, gguf_file
from common.config import EngineConfig
from engine.engine import LLMEngine
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.layers.linear import Linear, describe_linears
from engine.layers.parallel import SINGLE
from engine.layers.quantization import GROUPED_INT8, PartsWeight, QuantizedWeight, parts_weight
from engine.model_runner import resolve_dtype
from engine.models.gguf_dequant import BLOCK_BYTES, dequantize_blocks
from engine.models.gguf_metadata import file_quantization
from engine.models.loader import load_model
from tiny_models import VARIANTS, hf_greedy, make_checkpoint

Q = GGMLQuantizationType
PROMPTS = {"a": [5, 17, 99, 3, 42, 7], "b": [120, 8, 64, 33, 2, 150, 11, 90, 14]}
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# GGUF's per-layer names for Hugging Face's.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in glob:
        return glob[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (convert_hf_to_gguf's permute)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# Where each block type keeps its float16 scales (d, and dmin or m), by byte offset.
HALF_OFFSETS = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(rows: int, weights: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random codes in `qtype`'s blocks (gguf has no K-quant quantizer), with small float16
    scales: weights of the random checkpoints' size (about 0.1 to 1)."""
    size = BLOCK_BYTES[qtype.name]
    generator = np.random.default_rng(seed)
    data = generator.integers(0, 256, (rows, weights // size_weights(qtype) * size), np.uint8)
    blocks = data.reshape(-1, size)
    scale = 2e-4 if qtype == Q.Q6_K else 1e-3
    for at in HALF_OFFSETS[qtype.name]:
        halves = generator.normal(0.0, scale, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8)
    return data


def size_weights(qtype: GGMLQuantizationType) -> int:
    return 256 if qtype.name.endswith("_K") else 32


def write_gguf(
    path: Path,
    reference,
    linear_type: GGMLQuantizationType,
    dequantized: bool = False,
    arch: str = "llama",
    vocab_type: GGMLQuantizationType = Q.F32,
    part_types: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """The reference model as llama.cpp writes it for `arch`; linear weights in `linear_type`
    but those `part_types` names (q_proj, down_proj, ...) in their own, the token embedding (and
    an untied output) in `vocab_type` (or, with `dequantized`, those quantized values back in
    F32: the file's float32 twin)."""
    config = reference.config
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers' (its local: 10000)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    # Gemma 3's names from gguf's own map (its ffn_norm is the norm before the MLP), its window.
    names = None
    if arch == "gemma3":
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
        writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    for name, tensor in reference.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # a tied file has no output.weight
        values = tensor.float().numpy()
        if names is not None and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp's Gemma norms scale by w, Hugging Face's by 1 + w
        if names is not None:
            module, _, suffix = name.rpartition(".")
            file_name = f"{names.get_name(module)}.{suffix}"
        else:
            file_name = gguf_name(name)
        # llama.cpp permutes a llama's Q and K rows for its rope; Qwen's rotate as HF's do.
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = rope_permute(values, heads)
        is_linear = values.ndim == 2 and name.startswith("model.layers.")
        qtype = linear_type if is_linear else Q.F32
        for part, part_type in (part_types or {}).items():
            if is_linear and name.endswith(f".{part}.weight"):
                qtype = part_type
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            qtype = vocab_type
        if qtype != Q.F32:
            if qtype.name.endswith("_K"):
                seed = zlib.crc32(name.encode())
                blocks = random_blocks(*values.shape, qtype, seed)
            else:
                blocks = quantize(values, qtype)
            if dequantized:
                writer.add_tensor(file_name, dequantize(blocks, qtype))
            else:
                writer.add_tensor(file_name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(file_name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def engine_greedy(model: Path) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_num_batched_tokens=16,
            max_num_seqs=2,
        )
    )
    return greedy(engine, PROMPTS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), *VARIANTS["llama"])


def test_an_f32_gguf_gives_transformers_greedy_tokens(tmp_path, reference):
    got = engine_greedy(write_gguf(tmp_path / "tiny.gguf", reference, Q.F32))
    for rid, ids in PROMPTS.items():
        assert got[rid] == hf_greedy(reference, ids, GREEDY.max_tokens), rid


def test_an_engine_parses_its_gguf_once_and_keeps_no_parse(tmp_path, reference, monkeypatch):
    """The file's metadata is parsed once for the engine's config, tensor layout, weights and
    structured output's tokenizer, and nothing of the parse is left once the engine is built:
    no tokenizer build still running beside its first steps (it holds the interpreter lock),
    no parse kept for the engine's life."""
    parsed: list[weakref.ref] = []

    class CountedParse(gguf_file.GgufFile):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            parsed.append(weakref.ref(self))

    monkeypatch.setattr(gguf_file, "GgufFile", CountedParse)
    path = write_gguf(tmp_path / "tiny.gguf", reference, Q.Q8_0)
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=32)
    )
    assert len(parsed) == 1
    assert parsed[0]() is None
    assert greedy(engine, PROMPTS)  # and it serves


# Bound on the logits' relative error against the float32 twin through the integer kernels:
# F16, BF16, Q5_0 and Q5_1 are read exactly into float32 (only summation order differs); Q8_0's
# grouped int8 weights meet activations the kernels quantize to int16 per 32 features
# (measured: 7e-5), int4 weights activations quantized to int8 (measured: 1.8% on this model);
# the twin's stay float32.
@pytest.mark.parametrize(
    ("qtype", "max_error"),
    [
        (Q.F16, 1e-5),
        (Q.BF16, 1e-5),
        (Q.Q8_0, 3e-4),
        (Q.Q5_0, 1e-5),
        (Q.Q5_1, 1e-5),
        (Q.Q4_0, 0.03),
        (Q.Q4_1, 0.03),
    ],
)
def test_a_quantized_gguf_gives_its_float32_twin_s_tokens(
    tmp_path, reference, qtype, max_error, monkeypatch
):
    quantized = write_gguf(tmp_path / "q.gguf", reference, qtype)
    twin = write_gguf(tmp_path / "twin.gguf", reference, qtype, dequantized=True)
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    state = reference.state_dict()
    method = {Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q8_0: GROUPED_INT8}.get(qtype)
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        if method is None:  # read as floats
            assert not isinstance(module.packed, QuantizedWeight), name
            continue
        # The file's grid kept exactly (quantization is by rows: the rows' order does not
        # change it), rows back in Hugging Face's order.
        assert isinstance(module.packed, QuantizedWeight), name
        assert module.packed.method == method, name
        parts = FUSED.get(name.rpartition(".")[2], [name.rpartition(".")[2]])
        expected = np.concatenate(
            [
                dequantize(
                    quantize(state[f"{name.rpartition('.')[0]}.{p}.weight"].numpy(), qtype), qtype
                )
                for p in parts
            ]
        )
        assert torch.equal(module.packed.dequantized(torch.float32), torch.from_numpy(expected))

    kernels, dequantizing, dense_bf16 = logits_errors(model, twin_model, config, monkeypatch)
    print(
        f"{qtype.name}: logits relative error {kernels:.3%} (kernels), {dequantizing:.1e} "
        f"(dequantized, float32), {dense_bf16:.3%} (dequantized, bfloat16 where native)"
    )
    assert kernels <= max_error
    assert dequantizing <= 1e-5
    assert dense_bf16 <= max_error
    assert engine_greedy(quantized) == engine_greedy(twin)


def logits_errors(model, twin_model, config, monkeypatch) -> tuple[float, float, float]:
    """The relative error of the model's logits against its float32 twin's over one prompt:
    through the integer kernels (a decode's few rows), then through the dequantizing path of
    long prefills in float32 (the twin's float32 weights exactly, so only summation order
    differs: a CPU without native bfloat16), then as this CPU runs it (int4 weights' products
    in bfloat16 where the CPU computes it natively)."""
    from test_models import Runner

    def error() -> float:
        (logits,) = Runner(model, config).step([("a", PROMPTS["b"])])
        (twin_logits,) = Runner(twin_model, config).step([("a", PROMPTS["b"])])
        return float((logits - twin_logits).norm() / twin_logits.norm())

    kernels = error()
    limits = ("MAX_FOLIO_KERNEL_ROWS", "MAX_TORCH_KERNEL_ROWS", "MAX_INT4_KERNEL_ROWS")
    for limit in (*limits, "MAX_INT4_FLOAT32_KERNEL_ROWS"):
        monkeypatch.setattr(quantization, limit, 0)
    dense = error()
    dense_in_float32(monkeypatch, model)
    dequantizing = error()
    monkeypatch.undo()
    return kernels, dequantizing, dense


def dense_in_float32(monkeypatch, *models) -> None:
    """Every product of any row count through the dequantizing path in float32, as on a CPU
    without native bfloat16: in `models` and in those made from now on."""
    monkeypatch.setattr(quantization, "MAX_FOLIO_KERNEL_ROWS", 0)
    monkeypatch.setattr(quantization, "MAX_TORCH_KERNEL_ROWS", 0)
    monkeypatch.setattr(quantization, "MAX_INT4_FLOAT32_KERNEL_ROWS", 0)
    no_bf16 = dataclasses.replace(cpu_capabilities(), native_bf16=False)
    monkeypatch.setattr(quantization, "cpu_capabilities", lambda: no_bf16)
    for model in models:
        for module in model.modules():
            packed = getattr(module, "packed", None)
            for weight in getattr(packed, "parts", [packed]):
                if isinstance(weight, QuantizedWeight):
                    monkeypatch.setattr(weight, "dense_bf16", False)


@pytest.mark.parametrize("name", list(BLOCK_BYTES))
def test_blocks_dequantize_as_gguf_does(name):
    """Random codes and scales in each block type: Folio's torch dequantization equals gguf's
    own (numpy) bit for bit."""
    qtype = Q[name]
    rows = random_blocks(3, 4 * size_weights(qtype), qtype, seed=1)
    got = dequantize_blocks(torch.from_numpy(rows), name)
    assert torch.equal(got, torch.from_numpy(dequantize(rows, qtype)))
    assert got.shape == (3, 4 * size_weights(qtype))


def wide_reference(tmp_path: Path, tied: bool = False):
    """A tiny llama 256 wide: the K-quants' super-blocks hold 256 weights of a row."""
    wide = dict(
        VARIANTS["llama"][1], hidden_size=256, intermediate_size=256, tie_word_embeddings=tied
    )
    return make_checkpoint(tmp_path / "hf", VARIANTS["llama"][0], wide)


def test_a_q5_k_gguf_gives_its_float32_twin_s_tokens(tmp_path):
    """Q5_K read as floats, exactly: weights and logits equal the twin's written in F32 from
    gguf's dequantization of the same blocks, rows of Q and K unpermuted whole blocks at a time
    (so the engine's tokens are the twin's too)."""
    from test_models import Runner

    reference = wide_reference(tmp_path)
    quantized = write_gguf(tmp_path / "k.gguf", reference, Q.Q5_K)
    twin = write_gguf(tmp_path / "twin.gguf", reference, Q.Q5_K, dequantized=True)
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    for (name, weight), (_, twin_weight) in zip(
        model.state_dict().items(), twin_model.state_dict().items(), strict=True
    ):
        assert torch.equal(weight, twin_weight), name
    (logits,) = Runner(model, config).step([("a", PROMPTS["b"])])
    (twin_logits,) = Runner(twin_model, config).step([("a", PROMPTS["b"])])
    assert torch.equal(logits, twin_logits)


def test_a_q4_k_gguf_runs_on_the_int4_kernels_without_rounding(tmp_path, monkeypatch):
    """Q4_K's groups of 32 go into Folio's int4 layout with float32 scales and minimums (d * sc
    and -dmin * m; these random ones need more bits than float16 has): every layer's weight
    dequantized equals gguf's dequantization of the file's blocks bit for bit. Through the
    integer kernels the logits are the float32 twin's within the kernels' rounding of the
    activations to int8 per 32 features (bound 3%, as Q4_0/Q4_1's; measured 2.4%), through the
    dequantizing path within summation order (1e-5), where the engine's greedy tokens are the
    twin's. (Through the kernels they part where two logits are closer than that rounding: on
    this random model, one prompt's fourth token.)"""
    reference = wide_reference(tmp_path)
    quantized = write_gguf(tmp_path / "k.gguf", reference, Q.Q4_K)
    twin = write_gguf(tmp_path / "twin.gguf", reference, Q.Q4_K, dequantized=True)
    assert file_quantization(quantized) == "int4"
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    packed = linears_as_in_file(model, config, quantized, "int4")
    assert all(p.kernels is not None and p.scale.dtype == torch.float32 for p in packed)
    assert any((p.scale.half().float() != p.scale).any() for p in packed)
    k_quant_tracks_its_twin("Q4_K", model, twin_model, config, monkeypatch, quantized, twin)


def k_quant_tracks_its_twin(
    label: str, model, twin_model, config, monkeypatch, quantized: Path, twin: Path
) -> None:
    """A K-quant file's logits within 3% of its float32 twin's through the kernels and the
    bfloat16 dense path, within 1e-5 dequantized in float32; its greedy tokens the twin's
    through the dense path in float32."""
    kernels, dequantizing, dense_bf16 = logits_errors(model, twin_model, config, monkeypatch)
    print(
        f"{label}: logits relative error {kernels:.3%} (kernels), {dequantizing:.1e}, "
        f"{dense_bf16:.3%} (dequantized, bfloat16 where native)"
    )
    assert kernels <= 0.03 and dense_bf16 <= 0.03
    assert dequantizing <= 1e-5
    dense_in_float32(monkeypatch)
    assert engine_greedy(quantized) == engine_greedy(twin)


def linears_as_in_file(model, config, path: Path, method: str | None) -> list[QuantizedWeight]:
    """Every linear layer's weight (`method` on Folio's kernels; None: any of their layouts),
    which dequantized equals gguf's dequantization of the file's blocks bit for bit, the fused
    layers' parts and Q and K rows back in the file's order."""
    in_file = {
        t.name: dequantize(np.asarray(t.data), t.tensor_type) for t in gguf.GGUFReader(path).tensors
    }
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    weights = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        packed = module.packed
        assert isinstance(packed, QuantizedWeight), name
        assert method is None or packed.method == method, name
        assert packed.kernels is not None, name
        weights.append(packed)
        prefix, _, fused = name.rpartition(".")
        # The fused layer's parts as the file holds them, Q and K rows in its rope order.
        expected = [in_file[gguf_name(f"{prefix}.{p}.weight")] for p in FUSED.get(fused, [fused])]
        rows = packed.dequantized(torch.float32).numpy()
        parts = np.split(rows, np.cumsum([e.shape[0] for e in expected])[:-1])
        for part, values, in_gguf in zip(FUSED.get(fused, [fused]), parts, expected, strict=True):
            if part in heads:
                values = rope_permute(values, heads[part])
            assert np.array_equal(values, in_gguf), f"{prefix}.{part}"
    return weights


# Bound on the logits' relative error against the float32 twin through the grouped int8
# kernel, whose activations are int16 per 32 features (measured: Q8_0 1.3e-4, Q6_K 1.1e-4).
GROUPED_INT8_MAX_ERROR = 3e-4


@pytest.mark.parametrize(("qtype", "group"), [(Q.Q8_0, 32), (Q.Q6_K, 16)], ids=str)
def test_a_tied_int8_vocabulary_runs_on_the_grouped_int8_kernel(
    tmp_path, qtype, group, monkeypatch
):
    """Q8_0 (or Q6_K) linears and a tied token_embd of that type: every linear and the
    vocabulary projection run on Folio's grouped int8 kernel (groups of 32 with Q8_0's float16
    scales, or of 16 with Q6_K's d * sc in float32), the vocabulary one copy that the embedding
    looks rows up in (its float weight emptied). Every weight dequantized equals gguf's
    dequantization of the file's blocks bit for bit, looked-up embeddings the float32 twin's;
    the logits are the twin's within the kernel's int16 rounding of the activations
    (GROUPED_INT8_MAX_ERROR), within summation order through the dequantizing path, and the
    engine's greedy tokens are the twin's."""
    reference = wide_reference(tmp_path, tied=True)
    quantized = write_gguf(tmp_path / "q.gguf", reference, qtype, vocab_type=qtype)
    twin = write_gguf(tmp_path / "twin.gguf", reference, qtype, dequantized=True, vocab_type=qtype)
    assert file_quantization(quantized) == "int8"
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    assert config.tie_word_embeddings
    linears = linears_as_in_file(model, config, quantized, GROUPED_INT8)
    head = model.lm_head_packed
    assert isinstance(head, QuantizedWeight) and head.method == GROUPED_INT8
    assert describe_linears(model) == f"{len(linears) + 1} grouped int8 (Folio)"
    embedding = model.model.embed_tokens
    assert embedding.quantized is head and embedding.weight.numel() == 0
    for weight in [*linears, head]:
        assert weight.shape[1] == weight.scale.shape[1] * group
    token_embd = {t.name: t for t in gguf.GGUFReader(quantized).tensors}["token_embd.weight"]
    in_file = dequantize(np.asarray(token_embd.data), qtype)
    assert np.array_equal(head.dequantized(torch.float32).numpy(), in_file)
    ids = torch.tensor(PROMPTS["b"])
    twin_rows = twin_model.model.embed_tokens.lookup(ids, SINGLE)
    assert torch.equal(embedding.lookup(ids, SINGLE), twin_rows)
    kernels, dequantizing, dense = logits_errors(model, twin_model, config, monkeypatch)
    print(f"{qtype.name}: logits relative error {kernels:.1e} (kernels), {dequantizing:.1e}")
    assert kernels <= GROUPED_INT8_MAX_ERROR
    assert dequantizing <= 1e-5 and dense <= 1e-5  # grouped int8: float32 either way
    assert engine_greedy(quantized) == engine_greedy(twin)


def test_a_layer_mixing_q8_0_and_q6_k_runs_in_groups_of_16(tmp_path, monkeypatch):
    """Q8_0 linears but v_proj and down_proj in Q6_K (as llama.cpp's mixes keep some parts in
    more bits): the fused qkv_proj holding both is grouped int8 in groups of 16 with float32
    scales (a Q8_0 block's d for both its halves), the Q8_0-only layers keep groups of 32 with
    float16 scales; every weight equals gguf's dequantization bit for bit, and the logits are
    the float32 twin's within GROUPED_INT8_MAX_ERROR."""
    reference = wide_reference(tmp_path)
    mix = {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K}
    quantized = write_gguf(tmp_path / "q.gguf", reference, Q.Q8_0, part_types=mix)
    twin = write_gguf(tmp_path / "twin.gguf", reference, Q.Q8_0, dequantized=True, part_types=mix)
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    linears_as_in_file(model, config, quantized, GROUPED_INT8)
    layer = model.model.layers[0]
    for module, group, dtype in [
        (layer.self_attn.qkv_proj, 16, torch.float32),
        (layer.mlp.down_proj, 16, torch.float32),
        (layer.self_attn.o_proj, 32, torch.float16),
        (layer.mlp.gate_up_proj, 32, torch.float16),
    ]:
        packed = module.packed
        assert isinstance(packed, QuantizedWeight) and packed.scale.dtype == dtype
        assert packed.shape[1] == packed.scale.shape[1] * group
    kernels, dequantizing, dense = logits_errors(model, twin_model, config, monkeypatch)
    print(f"Q8_0 + Q6_K: logits relative error {kernels:.1e} (kernels), {dequantizing:.1e}")
    assert kernels <= GROUPED_INT8_MAX_ERROR
    assert dequantizing <= 1e-5 and dense <= 1e-5


def test_a_q4_k_m_gguf_keeps_its_mixed_layers_on_the_integer_kernels(tmp_path, monkeypatch):
    """As llama.cpp's Q4_K_M mixes types: Q4_K linears but v_proj in Q6_K, up_proj in Q6_K on
    layer 0 and down_proj on layer 1 (half the layers). The fused layers holding both (qkv_proj:
    q and k Q4_K, v Q6_K; layer 0's gate_up_proj) are parts weights, each run of parts in its
    own grid: int4 with Q4_K's float32 scales and minimums, grouped int8 in Q6_K's groups of 16
    (they were read as floats); every weight dequantized equals gguf's dequantization bit for
    bit. A parts weight's product equals its parts' own products side by side exactly, at a
    decode's rows, a batch's and a long prefill's. The logits are the float32 twin's within the
    int4 kernels' bound (3%, as a Q4_K file's), within summation order (1e-5) through the
    dequantizing path, where the engine's greedy tokens are the twin's."""
    reference = wide_reference(tmp_path)
    mix = {"v_proj": Q.Q6_K, "0.mlp.up_proj": Q.Q6_K, "1.mlp.down_proj": Q.Q6_K}
    quantized = write_gguf(tmp_path / "q.gguf", reference, Q.Q4_K, part_types=mix)
    twin = write_gguf(tmp_path / "twin.gguf", reference, Q.Q4_K, dequantized=True, part_types=mix)
    assert file_quantization(quantized) == "int4"
    model, config = load_model(quantized, torch.float32, "cpu")
    twin_model, _ = load_model(twin, torch.float32, "cpu")
    linears_as_in_file(model, config, quantized, None)
    first, second = model.model.layers
    for module in (first.self_attn.qkv_proj, second.self_attn.qkv_proj, first.mlp.gate_up_proj):
        packed = module.packed
        assert isinstance(packed, PartsWeight) and packed.method == "int4 + grouped int8"
        int4, int8 = packed.parts
        assert int4.method == "int4" and int4.scale.dtype == torch.float32
        assert int8.method == GROUPED_INT8 and int8.scale.dtype == torch.float32
        assert int8.shape[1] == int8.scale.shape[1] * 16
        assert int8.shape[0] == module.output_sizes[-1]  # v, or up
        for rows in (1, 5, 70, 300):
            x = torch.randn(rows, packed.shape[1])
            parts = torch.cat([part.matmul(x) for part in packed.parts], dim=-1)
            assert torch.equal(packed.matmul(x), parts), rows
    for module, method in [
        (first.self_attn.o_proj, "int4"),
        (first.mlp.down_proj, "int4"),
        (second.mlp.gate_up_proj, "int4"),
        (second.mlp.down_proj, GROUPED_INT8),
    ]:
        assert type(module.packed) is QuantizedWeight and module.packed.method == method
    assert "3 int4 + grouped int8 (Folio)" in describe_linears(model)
    k_quant_tracks_its_twin("Q4_K + Q6_K", model, twin_model, config, monkeypatch, quantized, twin)


def test_a_parts_weight_refuses_parts_it_cannot_multiply():
    """Parts of different input features, or on torch's kernels, are refused naming the
    problem, as is a product whose activations do not fit a part."""
    int4 = quantization.quantize(torch.randn(32, 64), "int4", folio_kernels=True)
    wider = quantization.quantize(torch.randn(32, 96), "int4", folio_kernels=True)
    on_torch = quantization.quantize(torch.randn(32, 64), "int4", folio_kernels=False)
    with pytest.raises(ValueError, match="same input features"):
        parts_weight([int4, wider])
    with pytest.raises(ValueError, match="Folio's kernels only"):
        parts_weight([int4, on_torch])
    with pytest.raises(ValueError, match=r"takes int4 and grouped int8 parts, got \['int8'\]"):
        parts_weight([quantization.quantize(torch.randn(32, 64), "int8", folio_kernels=True)])
    weight = parts_weight([int4, int4])
    assert weight.shape == (64, 64)
    with pytest.raises(RuntimeError, match="takes 64 input features; x has 96"):
        weight.matmul(torch.randn(2, 96))


def test_dtype_auto_keeps_a_4_bit_file_on_the_integer_kernels(tmp_path, reference):
    """The file's int4 (and a Q8_0 file's grouped int8) layers take float32 activations, as
    --quantization int4's do; a file of floats is none of Folio's quantizations."""
    int4 = write_gguf(tmp_path / "q4.gguf", reference, Q.Q4_1)
    int8 = write_gguf(tmp_path / "q8.gguf", reference, Q.Q8_0)
    floats = write_gguf(tmp_path / "f16.gguf", reference, Q.F16)
    assert [file_quantization(p) for p in (int4, int8, floats)] == ["int4", "int8", None]
    for path in (int4, int8):
        assert resolve_dtype("auto", "cpu", file_quantization(path)) == resolve_dtype(
            "auto", "cpu", "int4"
        )


def test_compiled_decode_runs_a_4_bit_file(tmp_path, reference):
    """Programs keyed by the file's config and tensor layout (it has no config.json), on
    float32 activations (dtype auto), give the eager engine's tokens; the Q8_0 embedding's rows
    are looked up in its grouped int8 copy inside them (and lm_head, untied, is grouped int8),
    and qkv_proj, its v in Q8_0, is a parts weight of int4 and grouped int8."""
    model = write_gguf(
        tmp_path / "q4.gguf", reference, Q.Q4_1, vocab_type=Q.Q8_0, part_types={"v_proj": Q.Q8_0}
    )

    def engine(eager: bool) -> LLMEngine:
        config = EngineConfig(
            model=str(model),
            block_size=4,
            num_kv_blocks=64,
            max_num_seqs=4,
            enforce_eager=eager,
            decode_compile="startup",
        )
        return LLMEngine(config)

    eager = greedy(engine(True), PROMPTS)
    compiled = engine(False)
    runner = compiled.executor.runner
    assert runner.model.model.embed_tokens.quantized is not None
    assert isinstance(runner.model.lm_head_packed, QuantizedWeight)
    assert runner.model.lm_head_packed.method == GROUPED_INT8
    assert isinstance(runner.model.model.layers[0].self_attn.qkv_proj.packed, PartsWeight)
    programs = compiled.executor.runner.compiled_decode
    assert programs is not None and programs.ready
    assert compiled.executor.runner.dtype == torch.float32
    assert greedy(compiled, PROMPTS) == eager
    assert programs.rows_run


def test_a_type_folio_does_not_read_is_refused_naming_it(tmp_path, reference):
    path = write_gguf(tmp_path / "k.gguf", reference, Q.F32)
    # Rewrite with one Q2_K tensor (raw blocks: gguf has no Q2_K quantizer).
    writer = GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
    from gguf import GGUFReader

    for field in GGUFReader(path).fields.values():
        if field.name.startswith("llama."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for tensor in GGUFReader(path).tensors:
        if tensor.name == "blk.0.attn_q.weight":
            writer.add_tensor(tensor.name, np.zeros((64, 84), np.uint8), raw_dtype=Q.Q2_K)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has type Q2_K"):
        load_model(tmp_path / "q2k.gguf", torch.float32, "cpu")


def test_the_default_model_s_own_gguf_served_as_it_is(default_model_dir, monkeypatch):
    """SmolLM2's Q4_1 GGUF (Q8_0 embedding) read as it is: its 4-bit weights are the prepared
    model's (transformers' float32 dequantization of that file), rows in Hugging Face's order,
    and through the dequantizing path it gives that model's float32 logits."""
    from safetensors import safe_open
    from test_models import Runner

    gguf_model, config = load_model(default_model.gguf_path(), torch.float32, "cpu")
    last = config.num_hidden_layers - 1
    with safe_open(default_model_dir / "model.safetensors", framework="pt") as f:
        for layer in (0, last):
            attention = gguf_model.get_submodule(f"model.layers.{layer}.self_attn")
            qkv = torch.cat(
                [f.get_tensor(f"model.layers.{layer}.self_attn.{p}_proj.weight") for p in "qkv"]
            )
            assert isinstance(attention.qkv_proj.packed, QuantizedWeight)
            # Equal but for a fused multiply-add's rounding in the dequantization.
            torch.testing.assert_close(
                attention.qkv_proj.packed.dequantized(torch.float32), qkv, rtol=1e-6, atol=1e-7
            )
    prepared, _ = load_model(default_model_dir, torch.float32, "cpu")
    dense_in_float32(monkeypatch, gguf_model)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198]
    (logits,) = Runner(gguf_model, config).step([("a", prompt)])
    (reference,) = Runner(prepared, config).step([("a", prompt)])
    assert float((logits - reference).norm() / reference.norm()) <= 1e-5


def test_what_a_gguf_is_not_served_with_is_refused(tmp_path, reference):
    from engine.layers.parallel import TensorParallel
    from engine.models.config import ModelConfig

    path = write_gguf(tmp_path / "tiny.gguf", reference, Q.F32)
    with pytest.raises(ValueError, match=r"leave quantization unset \(got 'int8'\)"):
        load_model(path, torch.float32, "cpu", quantization="int8")
    with pytest.raises(ValueError, match=r"tensor-parallel size 1 \(got 2\)"):
        load_model(path, torch.float32, "cpu", tp=TensorParallel(rank=0, size=2))
    writer = GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"general\.architecture 'phi3' is not served"):
        ModelConfig.from_dir(tmp_path / "phi3.gguf")


# Qwen2's q/k/v biases and tied embedding, Qwen3's q/k norms: each as llama.cpp writes it (no
# rope permutation), in Q8_0 and F32.
@pytest.mark.parametrize(
    ("variant", "arch", "qtype"),
    [("qwen2-bias-tied", "qwen2", Q.Q8_0), ("qwen3-qknorm", "qwen3", Q.F32)],
)
def test_qwen_ggufs_give_their_safetensors_twins_tokens(tmp_path, variant, arch, qtype):
    """A Qwen2 and a Qwen3 GGUF give the greedy tokens of the same weights served from a
    safetensors directory (the Q8_0 file's dequantized ones) and, in F32, transformers'."""
    reference = make_checkpoint(tmp_path / "hf", *VARIANTS[variant])
    path = write_gguf(tmp_path / f"{arch}.gguf", reference, qtype, arch=arch)
    if qtype != Q.F32:  # the directory holds the file's values
        with torch.no_grad():
            for name, weight in reference.named_parameters():
                if weight.dim() == 2 and name.startswith("model.layers."):
                    values = dequantize(quantize(weight.numpy(), qtype), qtype)
                    weight.copy_(torch.from_numpy(values))
        reference.save_pretrained(tmp_path / "hf")
    got = engine_greedy(path)
    assert got == engine_greedy(tmp_path / "hf")
    if qtype == Q.F32:
        for rid, ids in PROMPTS.items():
            assert got[rid] == hf_greedy(reference, ids, GREEDY.max_tokens), rid


def test_a_gemma3_gguf_gives_its_safetensors_twin_s_tokens(tmp_path):
    """Gemma 3 as llama.cpp writes it (norms stored as 1 + w, its post-attention and
    feed-forward norms' names, the window in its metadata) and runs it (every sixth layer global,
    local rope base 10000, attention scaled by the head size): the greedy tokens of the same
    model from safetensors, and transformers'."""
    config = dict(
        VARIANTS["gemma3-window3"][1],
        num_hidden_layers=6,
        query_pre_attn_scalar=16,
        final_logit_softcapping=None,
        layer_types=None,
        rope_parameters=None,
    )
    reference = make_checkpoint(tmp_path / "hf", VARIANTS["gemma3-window3"][0], config)
    assert reference.config.layer_types[4:] == ["sliding_attention", "full_attention"]
    path = write_gguf(tmp_path / "gemma3.gguf", reference, Q.F32, arch="gemma3")
    got = engine_greedy(path)
    assert got == engine_greedy(tmp_path / "hf")
    for rid, ids in PROMPTS.items():
        assert got[rid] == hf_greedy(reference, ids, GREEDY.max_tokens), rid
