"""A Folio child process that dies with the Folio process that started it (Linux).

`folio serve` starts its services, and an engine its tensor-parallel workers, with
PARENT_PID_ENV set to the starter's pid; the child arms the death signal itself once it runs
(folio.cli's main), never between fork and exec: no Python may run there in a process whose
gRPC threads are live (grpc's fork handlers abort the child).

Torch-free and service-free; it never signals anything but its own process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "FOLIO_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that must die with this process."""
    return {**os.environ, **(extra or {}), PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """SIGTERM when the starter dies, even by SIGKILL (strictly: when the thread that started
    this process ends). Nothing when not started that way. The variable is taken out of the
    environment, so this process's own children do not inherit it."""
    parent_pid = os.environ.pop(PARENT_PID_ENV, None)
    if parent_pid is None or sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent_pid):
        os.kill(os.getpid(), signal.SIGTERM)  # the starter died before the signal was armed
