"""Progress while minutes-long waits run, and how long each step of a run took.

`ProgressLine` writes one updating line on a terminal and plain lines elsewhere (or through a
writer the pytest plugin gives it); `StepClock` times the run's steps on the monotonic clock and
writes them to reports/<run-id>/steps.json. Neither touches a cluster.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from pytest_gpucanary.safe_text import one_line

STEPS_FILE = "steps.json"


class StepClock:
    """Wall time of each step of a run (monotonic clock, s), written to steps.json when the run ends."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._step: str | None = None
        self._since = time.monotonic()

    def next(self, step: str | None) -> None:
        now = time.monotonic()
        if self._step is not None:
            self.seconds[self._step] = self.seconds.get(self._step, 0.0) + now - self._since
        self._step, self._since = step, now

    def describe(self) -> str:
        return ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.seconds.items())

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"clock": "monotonic", "seconds": self.seconds}, indent=1) + "\n")


class ProgressLine:
    """Progress while minutes-long waits run: one updating line on a terminal, plain lines otherwise."""

    def __init__(self, write: Callable[[str], None] | None = None, *, stream: TextIO = sys.stderr) -> None:
        self._stream = stream
        self._write = write
        self._tty = write is None and stream.isatty()
        self._last = ""
        self._started = time.monotonic()

    def line(self, text: str) -> None:
        """A message that stays (a step began or ended)."""
        self._emit(text, final=True)

    def status(self, text: str) -> None:
        """A status that replaces the previous one on a terminal; printed only when it changes elsewhere."""
        if text != self._last:
            self._emit(text, final=False)
            self._last = text

    def _emit(self, text: str, *, final: bool) -> None:
        # cluster text reaches these lines: one line, so none can pose as a CI system's own command
        stamped = f"[gpucanary +{time.monotonic() - self._started:5.0f}s] {one_line(text)}"
        if self._write is not None:
            self._write(stamped)
        elif self._tty:
            self._stream.write("\r\033[K" + stamped + ("\n" if final else ""))
            self._stream.flush()
        else:
            print(stamped, file=self._stream, flush=True)
