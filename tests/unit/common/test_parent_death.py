"""common/parent_death.py: a child started with child_env() and arming die_with_parent() gets
SIGTERM when its starter is SIGKILLed, ends at once when its starter is already gone, and does
not pass the variable on to its own children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from common.parent_death import PARENT_PID_ENV

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

# The child: arms the signal, says what it inherited for its own children, then waits.
CHILD = (
    "import os, time; from common.parent_death import die_with_parent; die_with_parent(); "
    f"print(os.environ.get({PARENT_PID_ENV!r}, 'unset'), flush=True); time.sleep(120)"
)
# The starter: starts the child with child_env(), prints its pid, then waits to be killed.
STARTER = (
    "import subprocess, sys, time; from common.parent_death import child_env; "
    f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=child_env()); "
    "print(c.pid, flush=True); time.sleep(120)"
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def wait_gone(pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_dies_with_its_killed_starter_and_passes_nothing_on():
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    child = int(starter.stdout.readline())
    try:
        assert starter.stdout.readline().strip() == "unset"  # armed; nothing for its children
        assert alive(child)
        starter.kill()
        starter.wait()
        assert wait_gone(child), "the child outlived its SIGKILLed starter"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_starter_is_already_gone_ends_at_once():
    # The variable names a process that is not the parent: the starter died before arming.
    env = {**os.environ, PARENT_PID_ENV: "1"}
    child = subprocess.run([sys.executable, "-c", CHILD], env=env, timeout=60, check=False)
    assert child.returncode == -signal.SIGTERM
