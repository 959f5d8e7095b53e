"""`folio serve`'s supervisor. A child that dies is started again at once, then after a back-off
doubling with each death in a row, until it has died more often than --max-restarts allows.

A stop asked for by a signal ends `folio serve`'s watch wherever the signal lands. Python runs
a signal handler in the main thread between two of its bytecodes, also while that thread holds
a lock inside the supervisor's wait: a handler that took the same lock hung `folio serve` for
good on Ctrl-C (seen with two signals close together). The test runs the handler's call at each
line the waiting code executes in turn, as a signal landing there would, in a process of its
own so that a hang fails it by timing out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.supervisor import Child, ServeConfig, ServeError, Supervisor

# Trial k asks for the stop at the k-th line event of watch() and what it calls.
AT_EVERY_LINE = """
import sys
from services import supervisor
from services.supervisor import ServeConfig, Supervisor

supervisor.POLL_SECONDS = 0.001  # more of the waiting code's lines per trial

def stop_at(line, group):
    seen = 0
    def local(frame, event, arg):
        nonlocal seen
        if event == "line":
            seen += 1
            if seen == line:
                group.request_stop()
        return local
    return lambda frame, event, arg: local

for line in range(1, 120):
    group = Supervisor(ServeConfig())
    group.children = []  # nothing started: only the waiting loop itself
    sys.settrace(stop_at(line, group))
    group.watch()
    sys.settrace(None)
    assert group.stopping
print("every trial stopped")
"""


def test_a_stop_asked_for_at_any_point_of_the_wait_ends_it():
    result = subprocess.run(
        [sys.executable, "-c", AT_EVERY_LINE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every trial stopped" in result.stdout


def test_a_dying_child_restarts_at_once_then_backs_off_then_is_given_up(capsys, tmp_path):
    group = Supervisor(ServeConfig(max_restarts=2))
    # A real process that dies at once: `folio` refusing a command it does not know.
    output = (tmp_path / "output").open("w")
    dying = Child("engine", ["no-such-command"], lambda: lambda: False, 1.0, output)
    group.children = [dying]
    dying.start()
    with pytest.raises(ServeError, match=r"died 3 times in a row, more than --max-restarts 2"):
        group.watch()
    delays = [
        line.rsplit("restarting it in ", 1)[1] for line in capsys.readouterr().err.splitlines()
    ]
    assert delays == ["0 s", "0.5 s"]
    assert "invalid choice: 'no-such-command'" in (tmp_path / "output").read_text()
