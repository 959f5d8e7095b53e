"""LoRA adapters through the whole stack (tokenizer and engine services on loopback, the
gateway, the real openai client) on a tiny random SmolLM2: /v1/models lists the adapters with
the base model as parent; "model": NAME runs that adapter (greedy tokens of transformers +
peft); /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies) need an API key,
load only from inside --lora-root (the refusal names the rule), and an unload answers once the
adapter's running request has ended, which ends normally; its name is 404 from then on."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from common.config import EngineConfig, GatewayConfig
from common.tokenizer import Tokenizer
from gateway_helpers import GatewayThread
from grpc_helpers import TIMEOUT, ServerThread
from lora_adapters import make_adapter
from polling import wait_until
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import hf_greedy, make_tiny_smollm2

KEY = "lora-test-key"
PROMPT = [1, 504, 3102, 314, 253, 1615, 28, 2]  # token ids: no tokenizer differences


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora-root")
    base = make_tiny_smollm2(tmp_path_factory.mktemp("tiny"), default_model_dir)
    oracles = {
        "first": make_adapter(base, root / "first", rank=8, alpha=16, seed=1),
        "second": make_adapter(base, root / "second", rank=4, alpha=4, rslora=True, seed=2),
    }
    engine_config = EngineConfig(
        model=str(base),
        dtype="float32",
        enable_prefix_caching=False,
        max_num_seqs=8,
        num_kv_blocks=128,
        max_model_len=512,
        lora_modules=(f"first={root / 'first'}",),
        lora_root=str(root),
        max_loras=1,
        max_lora_rank=8,
    )
    tokenizer = ServerThread(TokenizerService(str(base), "127.0.0.1", 0))
    engine = ServerThread(EngineService(engine_config, "127.0.0.1", 0))
    gateway = GatewayThread(
        f"127.0.0.1:{engine.port}",
        f"127.0.0.1:{tokenizer.port}",
        GatewayConfig(api_keys=(KEY,)),
    )
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    yield gateway, client, base, oracles
    client.close()
    gateway.close()
    engine.close()
    tokenizer.close()


def greedy(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def oracle_text(base, oracle) -> str:
    return Tokenizer.from_dir(base).decode(hf_greedy(oracle, PROMPT, 6))


def post(gateway, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=TIMEOUT)


def test_models_list_adapters_with_their_parent(stack):
    _, client, base, _ = stack
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {base.name, "first"}
    assert cards["first"].parent == base.name and cards[base.name].parent is None


def test_model_name_picks_the_adapter(stack):
    _, client, base, oracles = stack
    assert greedy(client, "first") == oracle_text(base, oracles["first"])
    with pytest.raises(openai.NotFoundError, match="'second' does not exist"):
        greedy(client, "second")


def lora_series(gateway) -> tuple[str, float]:
    """/metrics' vllm:lora_requests_info line and the "first" adapter's request count."""
    text = httpx.get(gateway.url + "/metrics", timeout=TIMEOUT).text
    lines = text.splitlines()
    info = [line for line in lines if line.startswith("vllm:lora_requests_info{")]
    count = [
        line for line in lines if line.startswith('folio_lora_requests_total{lora_name="first"}')
    ]
    assert len(info) == 1 and len(count) == 1, text
    return info[0], float(count[0].split()[-1])


def test_metrics_show_the_adapters_and_their_requests(stack):
    gateway, client, _, _ = stack
    _, before = lora_series(gateway)
    greedy(client, "first")
    info, after = lora_series(gateway)
    assert after == before + 1
    # vLLM's shape: the adapters in the labels (none running or waiting once it ended), the
    # time of the answer as the value.
    assert 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info
    assert 'max_lora="1"' in info and float(info.split()[-1]) > 1e9


def test_runtime_load_needs_a_key_and_the_lora_root(stack, tmp_path):
    gateway, client, base, oracles = stack
    assert (
        post(
            gateway, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "first"}, key=None
        ).status_code
        == 401
    )
    refused = post(gateway, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert refused.status_code == 400
    assert "inside the server's --lora-root" in refused.json()["error"]["message"]
    missing = post(gateway, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nothing"})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    loaded = post(gateway, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "second"})
    assert loaded.status_code == 200, loaded.text
    # One slot: the two adapters take turns in it.
    assert greedy(client, "second") == oracle_text(base, oracles["second"])
    assert greedy(client, "first") == oracle_text(base, oracles["first"])


def test_unload_waits_for_the_running_request(stack):
    gateway, client, _, _ = stack
    if "second" not in {card.id for card in client.models.list().data}:
        assert (
            post(
                gateway, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "second"}
            ).status_code
            == 200
        )
    stream = client.completions.create(
        model="second",
        prompt=PROMPT,
        max_tokens=48,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # running
    answer: list[httpx.Response] = []
    unload = threading.Thread(
        target=lambda: answer.append(
            post(gateway, "/v1/unload_lora_adapter", {"lora_name": "second"})
        )
    )
    unload.start()
    wait_until(
        lambda: "second" not in {c.id for c in client.models.list().data}, "the unload", TIMEOUT
    )
    with pytest.raises(openai.NotFoundError):
        greedy(client, "second")
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    unload.join(TIMEOUT)
    assert finish == ["length"]
    assert answer and answer[0].status_code == 200, answer
    gone = post(gateway, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert (
        gone.status_code == 404
        and "no LoRA adapter named 'second'" in gone.json()["error"]["message"]
    )
