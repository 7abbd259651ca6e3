"""The load generator's plumbing without a cluster: sample parsing, the incremental log reader, the
command lines, and one short real locust run against a local HTTP server."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from harness import eventually
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_gpucanary.errors import ConfigError
from pytest_gpucanary.canary.load import DEFAULT_LOCUSTFILE, LoadRun, SampleLog, parse_samples
from pytest_gpucanary.ladder.model import Sample


def line(t_ns: int = 1, latency_s: float = 0.01, ok: bool = True, status: int = 200) -> str:
    return json.dumps({"t_ns": t_ns, "latency_s": latency_s, "ok": ok, "status": status}) + "\n"


def test_parse_samples_skips_torn_and_foreign_lines() -> None:
    text = line(1) + "not json\n" + '{"t_ns": 2}\n' + line(3, ok=False, status=503) + line(4)[:15]
    assert parse_samples(text) == [Sample(1, 0.01, True, 200), Sample(3, 0.01, False, 503)]


def test_sample_log_reads_complete_lines_incrementally_across_files(tmp_path: Path) -> None:
    first, second = tmp_path / "samples.jsonl.100", tmp_path / "samples.jsonl.200"
    first.write_text(line(5) + line(1)[:10])          # the second line is still being written
    second.write_text(line(3, ok=False, status=0))
    (tmp_path / "locust.log").write_text("not a sample file\n")
    log = SampleLog(tmp_path)
    assert [s.t_ns for s in log.read()] == [3, 5]
    with first.open("a") as f:
        f.write(line(1)[10:] + line(7))
    assert [s.t_ns for s in log.read()] == [1, 3, 5, 7]   # each line read once, sorted by start time
    assert [s.t_ns for s in log.read()] == [1, 3, 5, 7]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**62), st.floats(0, 60, allow_nan=False), st.booleans(),
                          st.integers(0, 599))), st.integers(0, 200))
def test_a_torn_last_line_never_loses_or_invents_a_sample(rows, cut) -> None:
    text = "".join(line(*row) for row in rows)
    whole = parse_samples(text)
    torn = parse_samples(text[:max(0, len(text) - cut)])
    assert len(whole) == len(rows)
    assert torn == whole[:len(torn)] and len(torn) >= len(rows) - 1 - cut // 40


def test_one_process_command_line() -> None:
    run = LoadRun("http://127.0.0.1:9/svc/ns/api/", users=3, spawn_rate=1.5, run_time_s=20.2, log_dir="/tmp/x")
    [argv] = run._commands()
    assert argv[:3] == [sys.executable, "-m", "locust"]
    assert argv[3:] == ["--headless", "-f", str(DEFAULT_LOCUSTFILE), "--host", "http://127.0.0.1:9/svc/ns/api",
                        "-u", "3", "-r", "1.5", "--run-time", "21s", "--only-summary"]


def test_distributed_command_lines_share_one_loopback_master_port() -> None:
    master, *workers = LoadRun("http://127.0.0.1:9", workers=2, log_dir="/tmp/x")._commands()
    port = master[master.index("--master-bind-port") + 1]
    assert "--master" in master and master[master.index("--expect-workers") + 1] == "2"
    assert master[master.index("--master-bind-host") + 1] == "127.0.0.1"
    assert "--expect-workers-max-wait" in master
    assert len(workers) == 2
    for worker in workers:
        assert worker[worker.index("--master-port") + 1] == port and "--worker" in worker
        assert worker[worker.index("--master-host") + 1] == "127.0.0.1" and "-u" not in worker


def test_locust_settings_from_the_environment_are_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCUST_HOST", "http://elsewhere")
    env = LoadRun("http://127.0.0.1:9", path="health", wait_s=0, log_dir="/tmp/x")._env()
    assert "LOCUST_HOST" not in env
    assert env["GPUCANARY_LOAD_LOG"] == "/tmp/x/samples.jsonl" and env["GPUCANARY_LOAD_PATH"] == "/health"


@pytest.mark.parametrize("bad", [{"users": 0}, {"run_time_s": 0}, {"workers": -1}, {"spawn_rate": 0}])
def test_bad_options_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError, match="load options out of range"):
        LoadRun("http://127.0.0.1:9", **bad)


@pytest.fixture
def flaky_server() -> Iterator[str]:
    """Answers 200, except every third request 503."""
    count = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            count[0] += 1
            self.send_response(503 if count[0] % 3 == 0 else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_real_locust_child_logs_every_request(flaky_server: str, tmp_path: Path) -> None:
    started_ns = time.time_ns()
    run = LoadRun(flaky_server, users=2, spawn_rate=10, run_time_s=3, log_dir=tmp_path).start()
    code = run.wait(timeout_s=30)
    samples = run.samples()
    assert code == 1, run.output_path.read_text()[-500:]     # locust exits 1 when any request failed
    assert run.error() is None
    assert {s.status for s in samples} == {200, 503}
    assert all(s.ok == (s.status == 200) for s in samples)
    assert all(started_ns <= s.t_ns <= time.time_ns() and s.latency_s >= 0 for s in samples)
    assert "Aggregated" in run.output_path.read_text()        # --only-summary still prints the summary
    assert "locust" not in sys.modules


def test_stop_is_bounded_and_a_broken_locustfile_is_reported(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no such locustfile setup')\n")
    run = LoadRun("http://127.0.0.1:9", locustfile=broken, run_time_s=60, log_dir=tmp_path / "out").start()
    code = run.wait(timeout_s=30)
    assert code is not None
    assert run.samples() == []
    assert "locust exited with code" in (run.error() or "")
    assert run.stop() == code and not run.running()    # locust had exited: nothing to signal or wait for


def test_stop_mid_run_interrupts_locust_and_keeps_its_samples(flaky_server: str, tmp_path: Path) -> None:
    run = LoadRun(flaky_server, users=2, spawn_rate=10, run_time_s=120, log_dir=tmp_path).start()
    eventually(run.samples, timeout_s=90, every_s=0.2)       # a bound on a loaded machine, not a speed claim
    code = run.stop(grace_s=60)            # SIGINT, then SIGKILL after the grace: ample on a loaded machine
    assert not run.running()
    assert code in (0, 1) and run.samples()
    assert "Aggregated" in run.output_path.read_text()        # SIGINT still lets locust print its summary
