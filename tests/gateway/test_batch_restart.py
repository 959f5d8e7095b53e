"""A batch job survives its gateway: `folio gateway` processes on one --batch-dir, killed
(SIGKILL) and then stopped (SIGTERM: drained) while a job is in progress, each started again;
the job completes with every line answered once, and no line answered before a stop runs again
(the database counts each line's runs)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import openai
from openai.types import Batch

from gateway_helpers import spawn_gateway
from grpc_helpers import TIMEOUT

LINES = 8
WAIT_SECONDS = 300.0
BODY = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def start(services, batch_dir: Path) -> tuple[subprocess.Popen, openai.OpenAI]:
    engine, tokenizer = services
    process = spawn_gateway(
        engine.port, tokenizer.port, "--batch-dir", str(batch_dir), "--batch-concurrency", "1"
    )
    line = process.stdout.readline()
    match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    assert match, line + process.stderr.read()
    return process, openai.OpenAI(base_url=match[1] + "/v1", api_key="unused", max_retries=0)


def wait_for(client: openai.OpenAI, batch_id: str, done: Callable[[Batch], bool]) -> Batch:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch


def stop_after(process: subprocess.Popen, client, batch_id: str, answered: int, stop) -> None:
    """Send `stop` once `answered` lines of the job are; wait for the process to end."""
    try:
        wait_for(client, batch_id, lambda b: b.request_counts.completed >= answered)
        process.send_signal(stop)
        process.communicate(timeout=TIMEOUT)
    finally:
        process.kill()


def runs(store_path: Path, batch_id: str) -> tuple[str, dict[int, int], set[int]]:
    """The job's status, each line's runs, and the lines answered, as the database has them."""
    with contextlib.closing(sqlite3.connect(store_path)) as db:
        (status,) = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        rows = db.execute(
            "SELECT line, attempts, state FROM lines WHERE batch_id = ?", (batch_id,)
        ).fetchall()
    return status, {line: n for line, n, _ in rows}, {line for line, _, s in rows if s == "done"}


def test_a_job_resumes_after_its_gateway_is_killed_or_stopped(services, tmp_path):
    store_path = tmp_path / "batches.sqlite3"
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": BODY}
        for i in range(LINES)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    process, client = start(services, tmp_path)
    try:
        file = client.files.create(file=("job.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
        )
    except BaseException:
        process.kill()
        raise
    stop_after(process, client, batch.id, 1, signal.SIGKILL)
    status, _, killed_done = runs(store_path, batch.id)
    assert status == "in_progress" and 1 <= len(killed_done) < LINES, "it ended before its gateway"

    process, client = start(services, tmp_path)
    stop_after(process, client, batch.id, len(killed_done) + 1, signal.SIGTERM)
    status, stopped_runs, stopped_done = runs(store_path, batch.id)
    assert status == "in_progress" and len(stopped_done) < LINES, "it ended before its gateway"
    # Killed: the line in flight had no answer and ran again; stopped: it was let finish.
    assert sum(stopped_runs.values()) - len(stopped_done) <= 1
    assert not set(stopped_runs.values()) - {0, 1, 2}

    process, client = start(services, tmp_path)
    try:
        done = wait_for(client, batch.id, lambda b: b.status == "completed")
        output = client.files.content(done.output_file_id).text.splitlines()
    finally:
        process.terminate()
        process.communicate(timeout=TIMEOUT)
    assert done.request_counts.completed == LINES and done.request_counts.failed == 0
    answers = [json.loads(line) for line in output]
    assert [a["custom_id"] for a in answers] == [f"line-{i}" for i in range(LINES)]
    # The same greedy request, answered alike before and after each restart.
    assert len({a["response"]["body"]["choices"][0]["text"] for a in answers}) == 1

    # A line answered before a stop never runs again.
    _, final_runs, _ = runs(store_path, batch.id)
    assert all(final_runs[line] == 1 for line in killed_done), final_runs
    assert all(final_runs[line] == stopped_runs[line] for line in stopped_done), final_runs
    # At most the one line in flight when the gateway was killed ran twice.
    assert sum(final_runs.values()) <= LINES + 1, final_runs
