"""Waits that poll a condition against a deadline: a test waits no longer than its condition
takes, and a condition that never comes fails it with a message naming what it waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05, what: str
) -> T:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that;
    TimeoutError naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(interval_s)
    return value


async def async_wait_until(
    predicate: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05, what: str
) -> T:
    """`wait_until` for a coroutine: yields to the event loop between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(interval_s)
    return value


def wait_settled(
    read: Callable[[], T], period_s: float, timeout_s: float, *, what: str
) -> T:
    """`read()` once two readings `period_s` apart agree: for values that components post
    periodically (every `period_s` at most), which have then all posted their latest."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while True:
        time.sleep(period_s)
        now = read()
        if now == last:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what} to settle; last: {now!r}")
        last = now
