"""`folio serve --tensor-parallel-size 3` with the default model: the engine starts two worker
ranks, the openai client gets answers; a worker killed (SIGKILL) under traffic ends every
request in flight within 15 s, the engine exits non-zero and `folio serve` restarts the whole
group, which answers again; SIGTERM then stops every process, the workers included."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from openai import OpenAI
from serve_process import ENGINE_ARGS, ServeProcess, alive, start_serve

END_SECONDS = 15.0  # the bound: a dead worker fails the requests within this
RECOVERY_SECONDS = 240.0  # three ranks import torch and load the model again, on 2 loaded cores


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory) -> ServeProcess:
    server = start_serve(
        tmp_path_factory.mktemp("tp") / "serve.log", *ENGINE_ARGS, "--tensor-parallel-size", "3"
    )
    yield server
    server.stop()


def client(server: ServeProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)


def workers(engine_pid: int) -> list[int]:
    """The engine's live worker ranks (its children running `folio engine-worker`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if int(ppid) == engine_pid and state != "Z" and "engine-worker" in cmdline:
            found.append(int(entry.name))
    return found


def ask(server: ServeProcess) -> str:
    openai = client(server)
    answer = openai.chat.completions.create(
        model=openai.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    return answer.choices[0].message.content


def wait_until(condition, timeout: float, what: str, server: ServeProcess) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {timeout} s:\n{server.output()}"
        time.sleep(0.1)


def test_three_ranks_answer_the_openai_client(server):
    assert len(workers(server.child_pid("engine"))) == 2
    assert ask(server)


def test_a_killed_worker_fails_requests_in_flight_then_the_group_is_restarted(server):
    engine = server.child_pid("engine")
    victim = workers(engine)[0]
    ended: list[float] = []
    errors: list[str] = []
    started = threading.Barrier(5)

    def stream() -> None:
        openai = client(server)
        try:
            chunks = openai.completions.create(
                model=openai.models.list().data[0].id,
                prompt="Count from one to one thousand:",
                max_tokens=400,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
            )
            for i, _chunk in enumerate(chunks):
                if i == 0:
                    started.wait(60)
        except Exception as exc:  # the error the stream ended with
            errors.append(str(exc))
        finally:
            ended.append(time.monotonic())

    flights = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
    for flight in flights:
        flight.start()
    started.wait(120)  # every stream has its first token
    since = len(server.output())
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for flight in flights:
        flight.join(max(killed_at + END_SECONDS - time.monotonic(), 0))
    assert len(ended) == 4, "a request hung after the worker died"
    assert len(errors) == 4, errors  # none ran to its 400 tokens
    # Each ended with the engine's own word on it (503: the engine is restarting).
    assert all("tensor-parallel worker rank" in e and "SIGKILL" in e for e in errors), errors
    # The engine exits non-zero and folio serve restarts it, with two fresh workers.
    server.wait_for_output(r"folio: engine exited with code 1 while serving", END_SECONDS, since)
    server.wait_for_output(r"folio: restarted engine \(pid \d+\)", RECOVERY_SECONDS, since)
    wait_until(
        lambda: "engine is serving again" in server.output()[since:],
        RECOVERY_SECONDS,
        "the engine did not serve again",
        server,
    )
    restarted = server.child_pid("engine")
    assert restarted != engine and not alive(victim)
    assert len(workers(restarted)) == 2
    assert ask(server)


def test_sigterm_stops_the_engine_and_its_workers(server):
    """Last in this module: it ends the shared server."""
    engine = server.child_pid("engine")
    ranks = workers(engine)
    assert len(ranks) == 2
    assert server.stop() == 0, server.output()
    assert not [pid for pid in [engine, *ranks] if alive(pid)], "a rank outlived folio serve"
