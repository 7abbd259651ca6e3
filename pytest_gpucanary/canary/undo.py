"""The run's undo stack: an ExitStack of every restore step, registered before the write it undoes, that
SIGINT and SIGTERM alike stop and that no later signal cuts short. A second signal waits until every step
has run; only SIGKILL abandons the restore, and `gpucanary cleanup` finishes it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any


class RestoringStack(contextlib.ExitStack):
    """An ExitStack whose run stops on SIGINT or SIGTERM alike and then restores with both deferred: the first
    signal unwinds the run (as Ctrl-C does), every later one, and any that comes once the restore has begun
    (`begin_restore`), waits until every callback has run and is raised then. The handler itself decides, so
    a signal that lands while the run prints "restoring the cluster" cannot cut the restore short; only SIGKILL
    abandons a restore, and `gpucanary cleanup` finishes it."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__()
        self._say = say
        self.restoring = False
        self._deferred: list[int] = []
        self._stopped_by = 0
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def __enter__(self) -> RestoringStack:
        if _main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return super().__enter__()

    def begin_restore(self) -> None:
        self.restoring = True

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.restoring:
            self.restoring, self._stopped_by = True, signum
            raise KeyboardInterrupt(f"signal {signum}")
        self._deferred.append(signum)
        with contextlib.suppress(RuntimeError):  # the signal landed inside a write to the same stream
            self._say(
                f"signal {signum} deferred: restoring the cluster first (SIGKILL abandons the restore; "
                "`gpucanary cleanup` then finishes it)"
            )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.restoring = True
        if self._stopped_by:  # said here, not in the handler, which may have cut into a write of this stream
            self._say(
                f"signal {self._stopped_by}: stopping the run and restoring the cluster (a second signal "
                "waits for the restore)"
            )
        try:
            suppressed = super().__exit__(exc_type, exc, tb)
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        if self._deferred and (exc_type is None or suppressed):
            raise KeyboardInterrupt(f"signal {self._deferred[0]}, deferred until the cluster was restored")
        return suppressed


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
