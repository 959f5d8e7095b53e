"""The batch store's leases, as several gateway processes (workers, a restarted gateway) meet
them on one database: one holder runs a job at a time; a line is started and answered under the
lease only; a lease that ran out, or whose holder's process died, passes to another holder, its
running lines waiting again and its late answers refused. The files it writes are JSON Lines any
line reader splits right."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time

import pytest

from gateway.batch.protocol import Batch, LineResponse, OutputLine
from gateway.batch.store import BatchStore, Holder, LeaseLost, ReadLine

OWNER = "anonymous"


@pytest.fixture
def store(tmp_path):
    store = BatchStore(tmp_path)
    yield store
    store.close()


def new_job(store: BatchStore) -> str:
    file = store.add_file(OWNER, "job.jsonl", "batch", b"unused here")
    batch = Batch(
        id="batch_test",
        endpoint="/v1/completions",
        input_file_id=file.id,
        completion_window="24h",
        status="validating",
        created_at=int(time.time()),
    )
    store.add_batch(OWNER, batch)
    return batch.id


def answer(line: int, body: dict | None = None) -> OutputLine:
    response = LineResponse(status_code=200, request_id=f"req_{line}", body=body or {})
    return OutputLine(id=f"batch_req_{line}", custom_id=f"c{line}", response=response)


def start_job(store: BatchStore, holder: Holder, lines: int) -> str:
    batch_id = new_job(store)
    assert store.claim(holder) == batch_id
    read = [ReadLine(i, f"c{i}", "/v1/completions", "{}") for i in range(1, lines + 1)]
    assert store.start(batch_id, holder, read).status == "in_progress"
    return batch_id


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_one_holder_runs_a_job(store):
    first, second = Holder(), Holder()
    batch_id = start_job(store, first, 2)
    assert store.claim(second) is None  # the lease is live
    assert store.start_line(batch_id, first, 1)
    assert not store.start_line(batch_id, first, 1)  # running already
    with pytest.raises(LeaseLost):
        store.start_line(batch_id, second, 2)
    store.finish_line(batch_id, first, 1, True, answer(1))
    assert store.renew(batch_id, first).request_counts.completed == 1
    assert [line.line for line in store.waiting_lines(batch_id)] == [2]


def test_a_lease_that_ran_out_passes_on(store):
    first, second = Holder(), Holder()
    batch_id = start_job(store, first, 2)
    assert store.start_line(batch_id, first, 1)
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE batches SET lease_until = 0")
    assert store.claim(second) == batch_id
    # The line the first holder was running waits again; its late answer is refused.
    assert [line.line for line in store.waiting_lines(batch_id)] == [1, 2]
    with pytest.raises(LeaseLost):
        store.finish_line(batch_id, first, 1, True, answer(1))
    assert store.start_line(batch_id, second, 1)
    store.finish_line(batch_id, second, 1, True, answer(1))
    assert store.attempts(batch_id) == {1: 2, 2: 0}


def test_a_dead_holders_job_passes_on_at_once(store):
    gone, heir = Holder(pid=dead_pid()), Holder()
    batch_id = start_job(store, gone, 1)
    assert store.claim(heir) == batch_id


def test_a_released_job_is_claimed_again_where_it_was(store):
    first, second = Holder(), Holder()
    batch_id = start_job(store, first, 3)
    for line in (1, 2):
        assert store.start_line(batch_id, first, line)
    store.finish_line(batch_id, first, 1, True, answer(1))
    store.release(batch_id, first)
    assert store.claim(second) == batch_id
    assert [line.line for line in store.waiting_lines(batch_id)] == [2, 3]
    for line in (2, 3):
        assert store.start_line(batch_id, second, line)
        store.finish_line(batch_id, second, line, line != 3, answer(line))
    store.set_status(batch_id, second, "finalizing")
    done = store.finish(batch_id, second, "completed", None)
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert store.file_content(OWNER, done.output_file_id).count(b"\n") == 2
    assert store.file_content(OWNER, done.error_file_id).count(b"\n") == 1
    assert store.file_content("someone-else", done.output_file_id) is None
    assert store.claim(first) is None  # nothing left to run


def test_an_output_file_is_one_line_an_answer_to_any_line_reader(store):
    # U+0085, U+2028 and U+2029 end lines for str.splitlines (JSON leaves them as they are).
    text = "a\x85b\u2028c\u2029d"
    holder = Holder()
    batch_id = start_job(store, holder, 2)
    for line in (1, 2):
        assert store.start_line(batch_id, holder, line)
        store.finish_line(batch_id, holder, line, True, answer(line, {"text": text * line}))
    done = store.finish(batch_id, holder, "completed", None)
    lines = store.file_content(OWNER, done.output_file_id).decode().splitlines()
    assert [json.loads(line)["response"]["body"]["text"] for line in lines] == [text, text * 2]
