"""A benchmark's output is kept for the docs as it printed it, and only from a run that ended well."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import figures  # noqa: E402  (tests/bench/figures.py)


def test_what_a_benchmark_prints_is_kept_with_its_command_and_a_failed_run_keeps_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(figures, "FIGURES", tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench_demo.py", "500"])
    with figures.recorded("tests/bench/bench_demo.py"):
        print("nodes 500 plan_s 0.1")
    assert capsys.readouterr().out == "nodes 500 plan_s 0.1\n"            # still printed as it ran
    header, body = (tmp_path / "bench_demo.txt").read_text().split("\n", 1)
    assert header.endswith(": python tests/bench/bench_demo.py 500") and "cores" in header
    assert body == "nodes 500 plan_s 0.1\n"
    with pytest.raises(SystemExit), figures.recorded("tests/bench/bench_demo.py"):
        print("half a table")
        sys.exit(1)
    with pytest.raises(RuntimeError), figures.recorded("tests/bench/bench_demo.py"):
        raise RuntimeError("fleet did not start")
    assert (tmp_path / "bench_demo.txt").read_text().split("\n", 1)[1] == body
