"""How a run behaves while it waits and unwinds: a second signal during the restore waits until every
restore step has run; the progress line says what the operator release is waiting for."""

from __future__ import annotations

import os
import signal

import pytest

from pytest_gpucanary.canary.undo import RestoringStack


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_restore_is_deferred_until_every_step_ran(signum: int) -> None:
    said: list[str] = []
    steps: list[str] = []
    handler_before = signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal starts a process
    with pytest.raises(KeyboardInterrupt, match="deferred until the cluster was restored"):
        with RestoringStack(said.append) as stack:
            stack.callback(steps.append, "policy restored")          # runs last
            stack.callback(lambda: (os.kill(os.getpid(), signum), steps.append("pool released")))
    assert steps == ["pool released", "policy restored"]
    assert said == [f"signal {signum} deferred: restoring the cluster first (SIGKILL abandons the restore; "
                    "`gpucanary cleanup` then finishes it)"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # handlers put back
    signal.signal(signal.SIGINT, handler_before)


def test_the_first_interrupt_still_propagates_and_a_second_one_is_not_raised_over_it() -> None:
    steps: list[str] = []
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt, match="^first$"):
        with RestoringStack(lambda line: None) as stack:
            stack.callback(lambda: (os.kill(os.getpid(), signal.SIGINT), steps.append("restored")))
            raise KeyboardInterrupt("first")
    assert steps == ["restored"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_lands_once_the_restore_began_waits_for_it(signum: int) -> None:
    """A signal that arrives while the run says "restoring the cluster" (its handler runs at the next bytecode,
    maybe before the stack unwinds) is deferred, not raised over the restore."""
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="deferred until the cluster was restored"):
        with RestoringStack(lambda line: None) as stack:
            stack.callback(steps.append, "restored")
            stack.begin_restore()
            os.kill(os.getpid(), signum)
            steps.append("the run went on to its restore")
    assert steps == ["the run went on to its restore", "restored"]


def test_the_first_signal_before_the_restore_stops_the_run_says_so_and_the_restore_still_runs() -> None:
    said: list[str] = []
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="^signal 15$"):
        with RestoringStack(said.append) as stack:
            stack.callback(steps.append, "restored")
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("never")
    assert steps == ["restored"]
    assert said == ["signal 15: stopping the run and restoring the cluster (a second signal waits for the restore)"]


def test_the_progress_line_says_a_v26_release_waits_for_its_requeue_once_the_new_driver_is_ready() -> None:
    from types import SimpleNamespace

    from canned_runs import HAPPY, NODE, operands, states

    from pytest_gpucanary.config import Settings
    from pytest_gpucanary.canary.pool import Pool
    from pytest_gpucanary.canary.waits import RunWaits

    records = sorted(states(list(zip([5, 10, 12, 14, 26], HAPPY[:5]))) + operands(), key=lambda r: r.received_wall_ns)
    run, pool = SimpleNamespace(settings=Settings()), Pool((NODE,), None, "580.82.07")
    line = RunWaits._status_text(run, pool, SimpleNamespace(records=records), 100.0, "v26.7.0")
    assert line.startswith(f"{NODE}: pod-restart-required | 100/1200 s | ")
    assert line.endswith("new driver pod Ready; this release moves on at its next 2-minute requeue")
    assert "requeue" not in RunWaits._status_text(run, pool, SimpleNamespace(records=records), 100.0, "v25.10.1")


def test_a_log_the_kubelet_cannot_give_while_it_replaces_the_container_is_read_again(monkeypatch) -> None:
    """A crash loop's previous container, read as the kubelet starts the next one: its answer is a line saying
    it has no log; a moment later it has."""
    from types import SimpleNamespace

    from pytest_gpucanary.canary import waits as waits_module
    from pytest_gpucanary.canary.waits import RunWaits
    from pytest_gpucanary.ladder.cause import Cause

    monkeypatch.setattr(waits_module.time, "sleep", lambda s: None)
    cause = Cause("gpu-kubelet-0", "driver pod", "CrashLoopBackOff", "", 0, 1, "gpu-operator", "driver-x",
                  "nvidia-driver-ctr")
    answers = ["unable to retrieve container logs for containerd://decf", "Installing...\nERROR: Unable to load\n"]
    said: list[str] = []
    noted: list = []
    run = SimpleNamespace(kube=SimpleNamespace(pod_log=lambda *a, **k: answers.pop(0)),
                          progress=SimpleNamespace(line=said.append))
    recorder = SimpleNamespace(records=[], note=noted.append)
    assert RunWaits._read_log(run, cause, recorder, previous=True) is True
    assert noted[0].object["lines"] == ["Installing...", "ERROR: Unable to load"] and said == []
    answers[:] = ["unable to retrieve container logs for containerd://decf"] * waits_module.LOG_READS
    assert RunWaits._read_log(run, cause, recorder, previous=True) is False
    assert said == ["rollout: cannot read the log of driver-x/nvidia-driver-ctr: unable to retrieve container logs "
                    "for containerd://decf"]


def test_the_newest_warning_of_a_pod_without_a_sandbox_is_recorded_once_and_read_again_only_later() -> None:
    from types import SimpleNamespace

    from pytest_gpucanary.canary.waits import RunWaits
    from pytest_gpucanary.ladder import diagnosis
    from pytest_gpucanary.ladder.cause import SANDBOX_NOT_READY, Cause

    cause = Cause("gpu-kubelet-0", "driver pod", SANDBOX_NOT_READY, "", 0, None, "gpu-operator",
                  "driver-x")
    events = [{"type": "Warning", "reason": "FailedMount", "message": "old", "lastTimestamp": "2026-12-05T01:00:00Z"},
              {"type": "Warning", "reason": "FailedCreatePodSandBox", "message": 'no runtime for "nvidia" is configured',
               "lastTimestamp": "2026-12-05T01:00:09Z"},
              {"type": "Normal", "reason": "Scheduled", "message": "assigned", "lastTimestamp": "2026-12-05T01:00:10Z"},
              {"type": "Warning", "reason": "MissingClusterDNS", "message": "kubelet does not have ClusterDNS IP",
               "lastTimestamp": "2026-12-05T01:00:11Z"}]
    asked: list[str] = []
    recorder = SimpleNamespace(records=[])
    recorder.note = recorder.records.append
    run = SimpleNamespace(kube=SimpleNamespace(list=lambda *a, **k: asked.append(k["field_selector"]) or events),
                          progress=SimpleNamespace(line=print))
    read_at: dict = {}
    assert RunWaits._read_warnings(run, [cause], recorder, read_at) is True
    assert asked == ["involvedObject.kind=Pod,involvedObject.name=driver-x"]
    assert diagnosis.last_warning(recorder.records, cause) == 'FailedCreatePodSandBox: no runtime for "nvidia" is configured'
    assert RunWaits._read_warnings(run, [cause], recorder, read_at) is False and len(asked) == 1   # not yet again
    read_at.clear()
    assert RunWaits._read_warnings(run, [cause], recorder, read_at) is False and len(recorder.records) == 1
