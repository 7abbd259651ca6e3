"""Each benchmark's last output as it printed it, kept in docs/figures/<benchmark>.txt: the docs show that file
at every build (docs/measurements.md, `<!-- figure: NAME -->`), so a figure there is what a benchmark printed,
never a copy. A benchmark wraps its run in `recorded(__file__)`; a run that fails records nothing."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

FIGURES = Path(__file__).resolve().parents[2] / "docs" / "figures"


class _Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(FIGURES.parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


@contextlib.contextmanager
def recorded(script: str) -> Iterator[None]:
    """What the block prints goes to stdout and, once it ends without an exception, to the figure file."""
    name = Path(script).stem
    kept = io.StringIO()
    real = sys.stdout
    sys.stdout = _Tee(real, kept)  # type: ignore[assignment]
    ok = False
    try:
        yield
        ok = True
    except SystemExit as exit_:
        ok = exit_.code in (None, 0)
        raise
    finally:
        sys.stdout = real
        if ok:
            _write(name, kept.getvalue())


def _write(name: str, output: str) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python", f"tests/bench/{name}.py", *sys.argv[1:]])
    header = f"# {now}, commit {_commit()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}: {command}\n"
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{name}.txt").write_text(header + output)
