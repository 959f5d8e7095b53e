"""Two real engine replicas of the default model behind `folio serve --engine-replicas 2` (one
stack for the module): a conversation's later turns go to the replica that served its first turn
and hit its prefix cache; killing one replica under traffic leaves the other serving and the
gateway healthy."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import httpx
import pytest
from serve_process import ENGINE_ARGS, ServeProcess, start_serve

import polling

TIMEOUT = 120
# Long enough (542 tokens) that the replica holding it answers a next turn clearly sooner than
# one computing it: the router weighs predicted time to first token, and on a two-block
# prompt a cache hit saves less than the noise in a freshly started replica's step timings.
SYSTEM = " ".join(
    [
        "You are a careful assistant for a small library. You answer questions about opening "
        "hours, loans, renewals and the reading room, briefly and politely, in plain words."
    ]
    + [f"Rule {i}: a book borrowed on day {i} is due back on day {i + 21}." for i in range(24)]
)


@pytest.fixture(scope="module")
def replicas_server(default_model_dir, tmp_path_factory) -> ServeProcess:
    server = start_serve(
        tmp_path_factory.mktemp("replicas") / "serve.log", *ENGINE_ARGS, "--engine-replicas", "2"
    )
    yield server
    server.stop()


def chat(url: str, messages: list[dict], max_tokens: int = 6) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=TIMEOUT,
    )


def replica_series(url: str, name: str) -> dict[str, float]:
    """A per-replica series of /metrics: replica address -> value."""
    prefix = name + '{replica="'
    series = {}
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            series[key[len(prefix) : -2]] = float(value)
    return series


# Polls with this file's deadline and pace.
wait_until = functools.partial(polling.wait_until, seconds=TIMEOUT, interval=0.1)


def test_a_conversation_stays_on_the_replica_that_caches_it(replicas_server):
    url = replicas_server.url
    addresses = replicas_server.engine_address.split(",")
    assert len(addresses) == 2
    before = replica_series(url, "folio_replica_requests_routed_total")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    served_by = None
    for turn in range(3):
        response = chat(url, messages)
        assert response.status_code == 200, response.text
        answer = response.json()
        routed = replica_series(url, "folio_replica_requests_routed_total")
        [replica] = [r for r in addresses if routed[r] - before.get(r, 0) == turn + 1]
        served_by = served_by or replica
        assert replica == served_by  # every turn on the replica of the first
        if turn:
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 400
        # The gateway learns what the replica cached (its KV events) before the next turn.
        wait_until(
            lambda r=served_by: replica_series(url, "folio_replica_indexed_blocks").get(r),
            "the turn's KV events",
        )
        messages += [
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Thank you. And question {turn}?"},
        ]
    hits = replica_series(url, "folio_replica_prefix_cache_hits_total")
    assert hits[served_by] > 0


def test_killing_a_replica_under_traffic_leaves_the_other_serving(replicas_server):
    url = replicas_server.url
    addresses = replicas_server.engine_address.split(",")
    outcomes: list[tuple[float, int]] = []  # (when it ended, HTTP status)
    stop = threading.Event()

    def traffic(index: int) -> None:
        while not stop.is_set():
            messages = [{"role": "user", "content": f"Count to three, client {index}."}]
            try:
                status = chat(url, messages, max_tokens=4).status_code
            except httpx.HTTPError:
                status = 0
            outcomes.append((time.monotonic(), status))

    clients = [threading.Thread(target=traffic, args=(i,)) for i in range(3)]
    for client in clients:
        client.start()
    try:
        wait_until(lambda: len(outcomes) >= 3, "traffic to flow")
        victim_port = addresses[1].rsplit(":", 1)[1]
        [victim] = [
            pid
            for pid, cmdline in replicas_server.children().items()
            if "folio.cli engine " in cmdline and f'"port": {victim_port},' in cmdline
        ]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # The gateway stays healthy and requests keep succeeding on the other replica.
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        wait_until(
            lambda: sum(1 for t, s in outcomes if t > killed_at + 1 and s == 200) >= 6,
            "requests to succeed after the kill",
        )
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        stop.set()
        for client in clients:
            client.join(TIMEOUT)
    # Only requests the dead replica had already started may fail, and only with 503.
    assert {s for _, s in outcomes} <= {200, 503}, outcomes
    assert sum(1 for _, s in outcomes if s == 503) <= 3
