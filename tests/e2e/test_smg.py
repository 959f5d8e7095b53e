"""Folio behind SMG (the Shepherd Model Gateway, PyPI `smg`, pinned in the test extras): two real
`folio serve` stacks of a tiny random-weight Llama with the default model's tokenizer (cheap to
run, real in every process), and `smg launch --policy cache_aware` in front of them. SMG
discovers both as SGLang-style workers (/server_info, /model_info) and polls their load
(/v1/loads); requests flow through it to both stacks; a conversation's turns stay on one stack,
whose prefix cache they hit, and a new conversation goes to the stack not busy; when one stack
dies SMG takes it out and serves from the other."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import ServeProcess, start_serve, wait_serving

import polling
from tiny_models import make_tiny_smollm2

SMG = Path(sys.executable).parent / "smg"
TIMEOUT = 120
STACK_ARGS = ("--dtype", "float32", "--num-kv-blocks", "2100", "--max-num-seqs", "8")
SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening "
    "hours, loans, renewals and the reading room, briefly and politely, in plain words."
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(default_model_dir, tmp_path_factory) -> Path:
    # A long context, so the request SMG must see running cannot end on its own first.
    return make_tiny_smollm2(
        tmp_path_factory.mktemp("tiny-smollm2"), default_model_dir, max_position_embeddings=32768
    )


@pytest.fixture(scope="module")
def stacks(tiny_model, tmp_path_factory) -> list[ServeProcess]:
    logs = tmp_path_factory.mktemp("stacks")
    servers = [
        start_serve(logs / f"serve-{i}.log", "--model", str(tiny_model), *STACK_ARGS, wait=False)
        for i in range(2)
    ]
    try:
        for server in servers:
            wait_serving(server)
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def smg(stacks, tmp_path_factory) -> str:
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    command = [
        str(SMG),
        "launch",
        "--worker-urls",
        *(s.url for s in stacks),
        "--policy",
        "cache_aware",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Poll load and health every second, and take a worker out at its first failed check,
        # so the test sees in seconds what SMG does in production over a minute.
        "--load-monitor-interval",
        "1",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--log-level",
        "info",
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: readiness(url).get("healthy_workers") == 2, "SMG to take both stacks")
        yield url
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text(errors='replace')}") from None
    finally:
        os.killpg(process.pid, 9)
        process.wait()


def readiness(url: str) -> dict:
    try:
        return httpx.get(url + "/readiness", timeout=TIMEOUT).json()
    except httpx.HTTPError:
        return {}


# Polls with this file's deadline and pace.
wait_until = functools.partial(polling.wait_until, seconds=TIMEOUT, interval=0.2)


def counters(stack: ServeProcess) -> dict[str, float]:
    """The stack's requests ended, prompt tokens found in its prefix cache and requests running
    in its engine."""
    text = httpx.get(stack.url + "/metrics", timeout=TIMEOUT).text
    found = {"requests": 0.0, "prefix_hits": 0.0, "running": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "folio_requests":
            found["requests"] = sum(s.value for s in family.samples)
        elif family.name == "folio_prefix_cache_hits":
            found["prefix_hits"] = family.samples[0].value
        elif family.name == "folio_num_requests_running":
            found["running"] = family.samples[0].value
    return found


def engine_loads(url: str) -> dict[str, dict]:
    """What SMG last polled of each worker's load: worker URL -> its one load snapshot."""
    workers = httpx.get(url + "/workers", timeout=TIMEOUT).json()["workers"]
    return {w["url"]: w["engine_load"]["loads"][0] for w in workers if w.get("engine_load")}


def chat(url: str, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0},
        timeout=TIMEOUT,
    )


@dataclass
class Conversation:
    messages: list[dict]
    home: int  # the stack that served every turn


def conversation(smg: str, stacks: list[ServeProcess], model: str, topic: str) -> Conversation:
    """Three turns on `topic` through SMG: each served by the same stack, the later ones with
    prefix-cache hits there."""
    messages = [
        {"role": "system", "content": f"{topic} are today's subject. {SYSTEM}"},
        {"role": "user", "content": f"Tell me about {topic.lower()}, please."},
    ]
    home = None
    for turn in range(3):
        before = [counters(s) for s in stacks]
        response = chat(smg, model, messages)
        assert response.status_code == 200, response.text
        stack = served_by(stacks, before)
        home = stack if home is None else home
        assert stack == home, f"turn {turn} of {topic!r} left its stack"
        if turn:
            assert counters(stacks[stack])["prefix_hits"] > before[stack]["prefix_hits"]
        content = response.json()["choices"][0]["message"]["content"]
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"And what else about {topic.lower()}?"},
        ]
    assert home is not None
    return Conversation(messages, home)


def served_by(stacks: list[ServeProcess], before: list[dict[str, float]]) -> int:
    """The one stack that ended one request since `before` (read until it shows)."""

    def counted() -> list[float] | None:
        growth = [
            counters(s)["requests"] - b["requests"] for s, b in zip(stacks, before, strict=True)
        ]
        return growth if sum(growth) else None

    growth = wait_until(counted, "the request to be counted")
    assert sorted(growth) == [0, 1], growth
    return growth.index(1)


def test_smg_routes_across_two_folio_stacks_and_survives_losing_one(stacks, smg, tiny_model):
    model = tiny_model.name
    # SMG found both as SGLang-style workers and reads their load from /v1/loads.
    workers = httpx.get(smg + "/workers", timeout=TIMEOUT).json()["workers"]
    assert {w["url"] for w in workers} == {s.url for s in stacks}
    for worker in workers:
        assert worker["runtime_type"] == "sglang"
        assert worker["labels"]["served_model_name"] == model
        assert int(worker["labels"]["max_total_tokens"]) > 0
    # The load SMG polls is the engine's: a request running on a stack (sent to it directly)
    # shows in SMG's view of that stack, and in no other.
    # The request would run over a minute (32,000 tokens of the tiny model; it ran out in 4-9 s
    # with 3,900 tokens, sometimes before SMG's first poll that saw it on a loaded machine), many
    # of SMG's 1 s polls; SMG is asked ~5 times a second while it streams, and the client leaves
    # as soon as SMG has seen it.
    busy = stacks[0]
    ended = counters(busy)["requests"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": 32000,
        "ignore_eos": True,
        "stream": True,
    }
    loads: dict[str, dict] = {}
    left_early = False
    with httpx.stream("POST", busy.url + "/v1/chat/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        asked = 0.0
        for line in r.iter_lines():  # read on, as a client does
            if time.monotonic() - asked > 0.2:
                asked = time.monotonic()
                loads = engine_loads(smg)
                if len(loads) == 2 and loads[busy.url]["num_running_reqs"]:
                    left_early = "[DONE]" not in line
                    break
    assert left_early, f"SMG never saw it run while it streamed: {loads}"
    assert loads[busy.url]["num_running_reqs"] == 1
    assert loads[stacks[1].url]["num_running_reqs"] == 0
    assert loads[busy.url]["max_total_num_tokens"] > 0
    assert 0 < loads[busy.url]["token_usage"] < 1
    # Leaving aborted it (an abort is not a request ended): the engine is idle again.
    wait_until(lambda: counters(busy)["running"] == 0, "the engine to drop the request")
    assert counters(busy)["requests"] == ended
    # And SMG sees it idle too: while its last poll still shows the request (a loaded machine
    # polls late), the stacks look imbalanced and SMG sends every conversation below to the
    # other one.
    wait_until(
        lambda: engine_loads(smg)[busy.url]["num_running_reqs"] == 0, "SMG to see the engine idle"
    )

    # A conversation's turns stay on one stack, whose prefix cache they hit (SMG matches a
    # request's text against what it sent each worker).
    first = conversation(smg, stacks, model, "Opening hours")
    # A conversation SMG has seen nothing of goes to the stack with the fewest requests in
    # flight: while the first conversation's next turn streams on its stack, a new one goes to
    # the other and stays there. (With both idle, SMG picks by its own order and counters: on a
    # loaded machine it sent four new conversations in a row to one stack.)
    messages = [*first.messages, {"role": "user", "content": "Now list every rule, slowly."}]
    body = {"model": model, "messages": messages, "max_tokens": 32000, "ignore_eos": True}
    with httpx.stream(
        "POST", smg + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as held:
        assert held.status_code == 200
        wait_until(lambda: counters(stacks[first.home])["running"] == 1, "the turn to run")
        second = conversation(smg, stacks, model, "Loans")
    assert {first.home, second.home} == {0, 1}, "a new conversation went to the busy stack"
    wait_until(lambda: counters(stacks[first.home])["running"] == 0, "the held turn to end")

    # One host dies: SMG's health checks take it out and the other serves everything.
    lost, survivor = stacks[0], stacks[1]
    lost.kill()
    wait_until(lambda: readiness(smg).get("healthy_workers") == 1, "SMG to drop the dead stack")
    before = counters(survivor)["requests"]
    for i in range(3):
        messages = [{"role": "user", "content": f"Question {i} after the outage?"}]
        response = chat(smg, model, messages)
        assert response.status_code == 200, response.text
    assert counters(survivor)["requests"] - before == 3
