"""--generation-config through the served path: what a model's generation_config.json
recommends (here top_k 1, temperature 0.9, max_new_tokens 5) samples what a request leaves
unset, its max_new_tokens caps every request, and what a request sets wins; with `folio` the
file is ignored, and --override-generation-config lays its own over either. Real tokenizer and
engine services on a tiny random-weight model with SmolLM2's tokenizer, three gateways over the
one engine, the real openai client."""

from __future__ import annotations

import json

import openai
import pytest

from common.config import EngineConfig, TokenizerOptions
from common.generation_config import SamplingDefaults, read_sampling_defaults
from gateway_helpers import ENGINE_ARGS, MAX_MODEL_LEN, GatewayThread
from grpc_helpers import ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

RECOMMENDED = {"top_k": 1, "temperature": 0.9, "max_new_tokens": 5, "do_sample": True}
MESSAGES = [{"role": "user", "content": "Count to ten"}]
NO_EOS = {"ignore_eos": True}
OVERRIDE = '{"top_k": 1, "max_new_tokens": 7}'


@pytest.fixture(scope="module")
def clients(tmp_path_factory, default_model_dir):
    """An openai client of a gateway whose tokenizer reads the model's file (auto), of one
    whose tokenizer ignores it (folio), and of one that ignores it but for an override."""
    model_dir = make_tiny_smollm2(tmp_path_factory.mktemp("tiny-generation"), default_model_dir)
    (model_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, **RECOMMENDED})
    )
    engine = ServerThread(
        EngineService(
            EngineConfig(model=str(model_dir), **dict(ENGINE_ARGS, dtype="float32")),
            "127.0.0.1",
            0,
        )
    )
    stacks = []
    for setting, override in (("auto", None), ("folio", None), ("folio", OVERRIDE)):
        tokenizer = ServerThread(
            TokenizerService(
                str(model_dir), "127.0.0.1", 0, TokenizerOptions(None, setting, override)
            )
        )
        gateway = GatewayThread(f"127.0.0.1:{engine.port}", f"127.0.0.1:{tokenizer.port}")
        stacks.append((tokenizer, gateway))
    yield [
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        for _, gateway in stacks
    ]
    for tokenizer, gateway in stacks:
        gateway.close()
        tokenizer.close()
    engine.close()


def chat(client: openai.OpenAI, **kwargs) -> tuple[str, int, str]:
    """The answer, its token count and its finish reason."""
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        extra_body=NO_EOS | kwargs.pop("extra_body", {}),
        **kwargs,
    )
    choice = reply.choices[0]
    return choice.message.content or "", reply.usage.completion_tokens, choice.finish_reason


def test_the_models_file_samples_what_a_request_leaves_unset(clients):
    model_defaults, folio_defaults, overridden = clients
    greedy, count, finish = chat(model_defaults, temperature=0.0, max_tokens=5)
    assert (count, finish) == (5, "length")
    # top_k 1 from the file: any temperature, any seed, the greedy answer; no max_tokens: 5.
    for seed in (1, 2):
        assert chat(model_defaults, seed=seed) == (greedy, 5, "length")
        assert chat(model_defaults, seed=seed, temperature=1.5) == (greedy, 5, "length")
    # The cap holds for a request that asks for more, in chat and completions alike.
    assert chat(model_defaults, temperature=0.0, max_tokens=12) == (greedy, 5, "length")
    completion = model_defaults.completions.create(
        model=model_defaults.models.list().data[0].id,
        prompt="Count to ten",
        max_tokens=12,
        extra_body=NO_EOS,
    )
    assert completion.usage.completion_tokens == 5
    # A prompt that leaves less room than the cap gets the room (max_tokens null: until the
    # context is full), not a 400 for a max_tokens it never set; echo with max_tokens 0 still
    # only scores the prompt.
    short = model_defaults.completions.create(
        model=model_defaults.models.list().data[0].id,
        prompt=[5] * (MAX_MODEL_LEN - 2),
        extra_body=NO_EOS | {"max_tokens": None},
    )
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (2, "length")
    scored = model_defaults.completions.create(
        model=model_defaults.models.list().data[0].id,
        prompt="Count to ten",
        max_tokens=0,
        echo=True,
        logprobs=0,
    )
    assert scored.usage.completion_tokens == 0
    # What the request sets wins: top_k off samples a random model's near-uniform tokens.
    sampled = {chat(model_defaults, seed=s, extra_body={"top_k": 0})[0] for s in (1, 2)}
    assert greedy not in sampled and len(sampled) == 2
    # folio: no cap (max_tokens 12 runs 12) and no top_k (a seeded sample is no greedy one).
    assert chat(folio_defaults, temperature=0.0, max_tokens=12)[1:] == (12, "length")
    assert chat(folio_defaults, seed=1, max_tokens=5)[0] != greedy
    # The override's top_k 1 and cap of 7: any seed, the greedy answer, 7 tokens long.
    longer, count, _ = chat(overridden, seed=3, max_tokens=12)
    assert count == 7 and longer.startswith(greedy)


def test_the_settings_read_the_model_a_directory_or_nothing(tmp_path, default_model_dir):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    )
    recommended = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert read_sampling_defaults(tmp_path, "auto") == recommended
    assert read_sampling_defaults(default_model_dir, str(tmp_path)) == recommended
    assert read_sampling_defaults(tmp_path, "folio") == SamplingDefaults()
    assert read_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()
    # SmolLM2's own file recommends no sampling; a GGUF file carries none.
    assert read_sampling_defaults(default_model_dir, "auto") == SamplingDefaults()
    assert read_sampling_defaults(tmp_path / "model.gguf", "auto") == SamplingDefaults()
    with pytest.raises(ValueError, match="generation_config must be auto, folio"):
        read_sampling_defaults(tmp_path, str(tmp_path / "missing"))
    # An override lays its keys over the file's; a bad one is named before anything serves.
    assert read_sampling_defaults(tmp_path, "auto", '{"top_k": 5, "max_new_tokens": 9}') == (
        SamplingDefaults(temperature=0.6, top_p=0.95, top_k=5, max_tokens=9)
    )
    for override, problem in (
        ('{"temp": 1}', "unknown key 'temp'"),
        ('{"top_p": "high"}', "top_p must be a number"),
        ('{"top_p": 0}', r"top_p must be in \(0, 1\]"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
    ):
        with pytest.raises(ValueError, match=problem):
            read_sampling_defaults(tmp_path, "auto", override)
