"""Time that moves only when a test moves it, for code that takes a clock (`lease.Clock`)."""

from __future__ import annotations

import threading


class ManualClock:
    """`monotonic()` reads `now`, which only the test changes; a wait lasts until the waiter is stopped, so a
    background loop never takes a turn of its own and the test takes each turn itself."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        stop.wait()
        return True
