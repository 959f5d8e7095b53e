"""Fixtures shared across the test suite."""

import os
from pathlib import Path

# Triton kernels run under the interpreter on CPU unless FOLIO_KERNEL_DEVICE=cuda. triton.jit
# binds a kernel when its module is imported, so this must happen before any test imports one.
if os.environ.get("FOLIO_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# Engines run eagerly in tests unless one asks otherwise (--no-enforce-eager, enforce_eager=False):
# compiling decode steps costs minutes on these machines. Read when common.config is imported.
os.environ.setdefault("FOLIO_ENFORCE_EAGER", "1")

# Engines start from the built-in step cost model, not the profile a developer's `folio bench
# profile` left in the cache: it gates drafting by batch size (engine.spec_decode.drafter), and a
# 2-core machine's profile stopped drafting at a test's 192 sequences. Inherited by the servers
# tests start.
os.environ.setdefault("FOLIO_STEP_COST", os.devnull)

import pytest

from common.default_model import prepare_default_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared default model (converted once into the Folio cache, reused afterwards)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def sentencepiece_style_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-2-style tokenizer (▁ for spaces, byte fallback, leading-space strip on decode).

    The default model's tokenizer is byte-level BPE; this one covers the other common family.
    """
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    corpus = [
        "Hello world, this is a tiny corpus.",
        "Streaming text token by token.",
        "héllo wörld",
        "The quick brown fox jumps over the lazy dog.",
    ]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.normalizer = normalizer
    trainer_tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False)
    )
    trained = json.loads(trainer_tokenizer.to_str())["model"]

    special = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(special + [f"<0x{b:02X}>" for b in range(256)])}
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    path = tmp_path_factory.mktemp("sentencepiece_style")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return path
