"""Our Llama-family model and loader against transformers on tiny random-weight checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import engine.layers.linear as linear_layers
from engine.kernels.cpu.capabilities import cpu_capabilities
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from paged import BlockPool, build_metadata
from tiny_models import VARIANTS, make_checkpoint

BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = make_checkpoint(directory, *VARIANTS[request.param])
    return directory, reference


def hf_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


class Runner:
    """A minimal paged driver: tracks each request's block table and length across steps."""

    def __init__(self, model, config: ModelConfig, num_blocks: int = 96):
        shape = (2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        dtype = model.model.embed_tokens.weight.dtype
        self.model = model
        self.caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.pool = BlockPool(num_blocks, seed=1)
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def share_prefix(self, source: str, target: str, num_tokens: int) -> None:
        """target starts with source's first num_tokens (whole blocks) already in the cache."""
        assert num_tokens % BLOCK_SIZE == 0
        self.tables[target] = self.tables[source][: num_tokens // BLOCK_SIZE]
        self.lengths[target] = num_tokens

    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """One forward over [(request, new tokens)], decodes first; logits per request."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for name, tokens in batch:
            start = self.lengths.get(name, 0)
            self.lengths[name] = start + len(tokens)
            tables.append(
                self.pool.grow(self.tables.setdefault(name, []), self.lengths[name], BLOCK_SIZE)
            )
            query_lens.append(len(tokens))
            seq_lens.append(self.lengths[name])
            ids += tokens
            positions += range(start, start + len(tokens))
        meta = build_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def random_tokens(n: int, seed: int, vocab: int = 160) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TOL = dict(atol=1e-4, rtol=1e-4)


def test_ragged_prefill_then_batched_decode(variant):
    directory, reference = variant
    model, config = load_model(directory, torch.float32, "cpu")
    runner = Runner(model, config)
    prompts = {"a": random_tokens(5, 1), "b": random_tokens(11, 2), "c": random_tokens(3, 3)}

    outputs = runner.step(list(prompts.items()))
    for tokens, logits in zip(prompts.values(), outputs, strict=True):
        torch.testing.assert_close(logits, hf_logits(reference, tokens), **TOL)

    sequences = {name: list(tokens) for name, tokens in prompts.items()}
    last = {name: out[-1] for name, out in zip(prompts, outputs, strict=False)}
    for _ in range(4):
        for name in sequences:
            sequences[name].append(int(last[name].argmax()))
        outputs = runner.step([(name, seq[-1:]) for name, seq in sequences.items()])
        for (name, seq), logits in zip(sequences.items(), outputs, strict=False):
            assert logits.shape[0] == 1
            torch.testing.assert_close(logits[0], hf_logits(reference, seq)[-1], **TOL)
            last[name] = logits[0]


def test_chunked_prefill(variant):
    directory, reference = variant
    model, config = load_model(directory, torch.float32, "cpu")
    runner = Runner(model, config)
    prompt = random_tokens(13, 4)
    expected = hf_logits(reference, prompt)
    (first,) = runner.step([("a", prompt[:6])])
    (second,) = runner.step([("a", prompt[6:])])
    torch.testing.assert_close(first, expected[:6], **TOL)
    torch.testing.assert_close(second, expected[6:], **TOL)


def test_cached_prefix_in_a_mixed_batch(variant):
    """b reuses a's first two blocks and extends them in the same step as a decodes."""
    directory, reference = variant
    model, config = load_model(directory, torch.float32, "cpu")
    runner = Runner(model, config)
    a = random_tokens(10, 5)
    (a_logits,) = runner.step([("a", a)])
    a.append(int(a_logits[-1].argmax()))

    runner.share_prefix("a", "b", 8)
    b = a[:8] + random_tokens(5, 6)
    a_next, b_logits = runner.step([("a", a[-1:]), ("b", b[8:])])
    torch.testing.assert_close(a_next[0], hf_logits(reference, a)[-1], **TOL)
    torch.testing.assert_close(b_logits, hf_logits(reference, b)[8:], **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers(tmp_path, dtype):
    """Ours in low precision may not be further from float32 than transformers in the same dtype."""
    reference = make_checkpoint(tmp_path, *VARIANTS["llama-gqa3-tied-llama3rope"])
    model, config = load_model(tmp_path, dtype, "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == dtype
    prompts = [random_tokens(9, 7), random_tokens(4, 8)]
    outputs = Runner(model, config).step([(str(i), p) for i, p in enumerate(prompts)])
    low = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=dtype, attn_implementation="eager"
    ).eval()
    for prompt, logits in zip(prompts, outputs, strict=False):
        exact = hf_logits(reference, prompt)
        ours = (logits - exact).abs().max().item()
        theirs = (hf_logits(low, prompt) - exact).abs().max().item()
        assert ours <= 2 * theirs + 1e-2, (ours, theirs)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"]
)
def test_packed_linears_match_plain_ones(tmp_path, monkeypatch, dtype, tolerance):
    """The CPU's packed paths (float32: oneDNN's layout through Folio's packed_linear op;
    bfloat16: Folio's tiles through bf16_linear) give the logits of plain F.linear, within
    rounding. The qwen2 variant has biases on q/k/v."""
    from test_layers import NO_FOLIO_KERNELS

    make_checkpoint(tmp_path, *VARIANTS["qwen2-bias-tied"])
    prompts = [random_tokens(9, 7), random_tokens(4, 8)]
    packed_model, config = load_model(tmp_path, dtype, "cpu")
    packed_layer = packed_model.model.layers[0].self_attn.qkv_proj.packed
    if packed_layer is None:
        pytest.skip(f"this torch build or CPU packs no {dtype} weights")
    assert isinstance(packed_layer, linear_layers.Bf16Tiles) == (dtype == torch.bfloat16)
    assert packed_model.lm_head_packed is not None
    packed = Runner(packed_model, config).step([(str(i), p) for i, p in enumerate(prompts)])
    monkeypatch.setattr(linear_layers, "cpu_capabilities", lambda: NO_FOLIO_KERNELS)
    plain_model, _ = load_model(tmp_path, dtype, "cpu")
    assert plain_model.model.layers[0].mlp.down_proj.packed is None
    # torch's own products, not oneDNN's: on CPUs with AMX oneDNN's bfloat16 products round
    # apart from Folio's tiles by up to 0.05 on these logits (without AMX within 2e-2).
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    plain = Runner(plain_model, config).step([(str(i), p) for i, p in enumerate(prompts)])
    for a, b in zip(packed, plain, strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_bf16_tiles_compute_the_float32_product_rounded_once():
    """bf16_linear on shapes off its tiles (outputs not a multiple of 16, 2 to 19 rows, so
    every row and tile tail), with a bias and strided activation rows: the float32 product of
    the same bfloat16 values, rounded once (a bfloat16 unit apart at most, from summation
    order)."""
    weight = torch.randn(40, 18, generator=torch.Generator().manual_seed(0)).bfloat16()
    if not cpu_capabilities().bf16_tiles:
        pytest.skip("this CPU has no AVX-512 BF16 (or Folio's kernels do not load)")
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(40, generator=generator).bfloat16()
    tiles = linear_layers.pack_weight(weight)
    assert isinstance(tiles, linear_layers.Bf16Tiles)
    for rows in (1, 2, 7, 8, 9, 19):
        x = torch.randn(rows, 30, generator=generator).bfloat16()[:, 5:23]  # rows 30 apart
        out = tiles.matmul(x, bias)
        exact = x.float() @ weight.float().t() + bias.float()
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
        unit = exact.abs() * 2**-7 + 1e-5
        assert ((out.float() - exact).abs() <= unit).all(), rows
    batched = tiles.matmul(x.reshape(1, rows, 18))
    assert batched.shape == (1, rows, 40)
    assert torch.equal(batched[0], tiles.matmul(x))
    with pytest.raises(RuntimeError, match="activations have 17 features, the weight 18"):
        tiles.matmul(torch.zeros(1, 17).bfloat16())


def test_sharded_checkpoint(tmp_path):
    reference = make_checkpoint(tmp_path, *VARIANTS["qwen3-qknorm"])
    reference.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    model, config = load_model(tmp_path, torch.float32, "cpu")
    prompt = random_tokens(7, 9)
    (logits,) = Runner(model, config).step([("a", prompt)])
    torch.testing.assert_close(logits, hf_logits(reference, prompt), **TOL)


def test_checkpoint_mismatches_are_named(tmp_path):
    make_checkpoint(tmp_path, *VARIANTS["llama"])
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_model(tmp_path, torch.float32, "cpu")
    assert "model.layers.1.self_attn.qkv_proj.weight (shard 1)" in str(error.value)
    assert "model.layers.0.mlp.extra_proj.weight" in str(error.value)

    weights = load_file(tmp_path / "model.safetensors")
    weights.pop("model.layers.0.mlp.extra_proj.weight")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(5, 64)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj.weight.*shape \(5, 64\)"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(tmp_path, torch.float32, "cpu")


BASE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    max_position_embeddings=64,
)


def test_config_layouts():
    # transformers 4 layout: rope settings at the top level, eos as a list, no head_dim.
    old = ModelConfig.from_dict(
        dict(
            BASE,
            rope_theta=500000.0,
            eos_token_id=[5, 6],
            rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
        )
    )
    assert old.rope_theta == 500000.0 and old.rope_scaling["rope_type"] == "llama3"
    assert old.head_dim == 4 and old.num_key_value_heads == 2 and old.eos_token_ids == [5, 6]
    # transformers 5 layout, with generation_config.json adding an end token.
    new = ModelConfig.from_dict(
        dict(BASE, eos_token_id=5, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        {"eos_token_id": [5, 7]},
    )
    assert new.rope_theta == 1e6 and new.rope_scaling is None and new.eos_token_ids == [5, 7]
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(
            dict(BASE, rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0))
        )


def test_sliding_windows_per_layer_and_no_cap_on_the_context():
    def windows(**raw):
        config = ModelConfig.from_dict(dict(BASE, num_hidden_layers=4, **raw))
        assert config.max_position_embeddings == 64  # never capped at the window
        return config.layer_windows

    mistral = dict(architectures=["MistralForCausalLM"], model_type="mistral")
    assert windows(**mistral, sliding_window=16) == [16] * 4
    assert windows(**mistral, sliding_window=None) == [None] * 4
    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=16)
    assert windows(**qwen, use_sliding_window=False) == [None] * 4
    # Qwen2's convention: layers from max_window_layers on slide.
    assert windows(**qwen, use_sliding_window=True, max_window_layers=2) == [None, None, 16, 16]
    assert windows(**qwen, layer_types=["sliding_attention", "full_attention"] * 2) == [
        16,
        None,
        16,
        None,
    ]
    gemma = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8)
    assert windows(**gemma, sliding_window_pattern=2) == [8, None, 8, None]
    with pytest.raises(ValueError, match=r"layer_types.*full_attention, sliding_attention"):
        windows(**qwen, layer_types=["chunked_attention"] * 4)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        windows(**mistral, sliding_window=0)
    qwen = dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert (
        ModelConfig.from_dict(qwen).attention_bias and not ModelConfig.from_dict(qwen).o_proj_bias
    )
