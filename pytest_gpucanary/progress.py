"""Progress while minutes-long waits run: one updating line on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class ProgressLine:
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
        stamped = f"[gpucanary +{time.monotonic() - self._started:5.0f}s] {text}"
        if self._write is not None:
            self._write(stamped)
        elif self._tty:
            self._stream.write("\r\033[K" + stamped + ("\n" if final else ""))
            self._stream.flush()
        else:
            print(stamped, file=self._stream, flush=True)
