"""Pins bounded per API key through the real gateway, in front of a real engine (a tiny
SmolLM2-shaped model, prefix caching on): a chat's `cache` extension pins its prompt under an
owner named by the key's digest, never the key; past --max-pinned-gib-per-key a key's prompt is
pinned up to the bound while another key's pins stay; /metrics counts the pinned blocks; without
keys every caller is one owner; a bad value of the flag is refused at start-up naming it."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import httpx
import pytest

from common.config import EngineConfig, GatewayConfig
from gateway_helpers import ENGINE_ARGS, read_metrics, start_gateway
from grpc_helpers import TIMEOUT, ServerThread
from services.engine.server import EngineService
from services.tokenizer.server import TokenizerService
from tiny_models import make_tiny_smollm2

MODEL = "tiny-pins"
KEYS = ("sk-pin-key-a", "sk-pin-key-b")
GIB = 1024**3
# Each key may pin 2 blocks (of 16 tokens).
BOUND_BLOCKS = 2
LONG_TEXT = " ".join(f"item {i} is {i * 7 % 13}" for i in range(40))  # well over 2 blocks


@pytest.fixture(scope="module")
def services(tmp_path_factory, default_model_dir):
    directory = make_tiny_smollm2(tmp_path_factory.mktemp(MODEL, numbered=False), default_model_dir)
    tokenizer = ServerThread(TokenizerService(str(directory), "127.0.0.1", 0))
    config = dict(ENGINE_ARGS, dtype="float32", enable_prefix_caching=True)
    engine = ServerThread(
        EngineService(EngineConfig(model=str(directory), **config), "127.0.0.1", 0)
    )
    yield engine, tokenizer
    engine.close()
    tokenizer.close()


def engine_of(services):
    """The LLMEngine behind the engine service (read once its requests are done)."""
    return services[0].service.engine.engine


def pinned_chat(url: str, text: str, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "cache": {"pin_prefix": True, "ttl_seconds": 600},
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert response.status_code == 200, response.text


def owner(key: str) -> str:
    return "key-sha256:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def test_a_key_past_its_bound_is_clipped_and_another_keys_pins_stay(services, caplog):
    engine = engine_of(services)
    gib = (BOUND_BLOCKS + 0.5) * engine.executor.kv_block_bytes / GIB
    server = start_gateway(services, api_keys=KEYS, max_pinned_gib_per_key=gib)
    try:
        pinned_chat(server.url, "hi", KEYS[1])  # one block or two: within the bound
        pins = engine.kv_cache.pins
        within = pins.owned(owner(KEYS[1]))
        assert 1 <= within <= BOUND_BLOCKS
        pinned_chat(server.url, LONG_TEXT, KEYS[0])
        assert pins.owned(owner(KEYS[0])) == BOUND_BLOCKS
        assert pins.owned(owner(KEYS[1])) == within
        # Pinning the same prompt again counts nothing more.
        pinned_chat(server.url, LONG_TEXT, KEYS[0])
        assert pins.owned(owner(KEYS[0])) == BOUND_BLOCKS
        assert pins.owned(KEYS[0]) == 0  # the key itself never names the owner
        # /metrics counts each pinned block once, whoever pinned it.
        assert read_metrics(server.url)["folio_kv_pinned_blocks"] == pins.num_pinned
        assert pins.num_pinned >= BOUND_BLOCKS
    finally:
        server.close()
    assert all(key not in caplog.text for key in KEYS)


def test_without_keys_every_caller_is_one_owner(services):
    server = start_gateway(services)
    try:
        pinned_chat(server.url, "one caller")
        pinned_chat(server.url, "another caller")
        assert engine_of(services).kv_cache.pins.owned("anonymous") >= 2
    finally:
        server.close()


@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_a_bad_bound_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match="--max-pinned-gib-per-key must be a number >= 0"):
        GatewayConfig(max_pinned_gib_per_key=value)


def test_a_bound_that_is_not_a_number_is_refused_at_start_up():
    command = [sys.executable, "-m", "folio.cli", "gateway", "--max-pinned-gib-per-key", "lots"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0 and "--max-pinned-gib-per-key" in done.stderr
