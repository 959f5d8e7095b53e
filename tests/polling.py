"""Waiting in tests: poll a condition until it holds or a deadline passes; never a duration
asserted, so a slow, loaded machine only waits longer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, seconds: float, interval: float = 0.05) -> T:
    """condition()'s first truthy value, polled every `interval` seconds; fails naming `what`
    after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
    return value
