"""A finished run's verdict: keyed by exactly what it proved, kept in the cluster without an older run ever
replacing a newer one, read back by `gpucanary verdict`, and pushed to a real Prometheus Pushgateway."""

from __future__ import annotations

import dataclasses
import json
import socket
import urllib.request
from pathlib import Path

import pytest
from kube_double import FakeKube
from canned_runs import NEW, T0, clean_run, field_note_run   # canned runs, shared

from pytest_gpucanary.canary import publish
from pytest_gpucanary.cli import main
from pytest_gpucanary.config import Settings
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.ladder import RunEvidence, evaluate
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.receipt.verdict import Verdict, VerdictKey
from pytest_gpucanary.shipped import FIXTURES

POLICY = {"autoUpgrade": True, "maxParallelUpgrades": 1, "maxUnavailable": "25%",
          "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False}}


def verdict_of(evidence: RunEvidence) -> Verdict:
    evidence = dataclasses.replace(evidence, upgrade_policy=POLICY, operator_release="v26.7.0", run_id="r1",
                                   finished_wall_ns=T0 + 600 * 10**9)
    return Verdict.of(evaluate(evidence, Settings()), evidence)


def test_the_key_is_the_policy_as_applied_the_target_and_the_release() -> None:
    key = VerdictKey.of(POLICY, NEW, "v26.7.0")
    reordered = dict(reversed(list(POLICY.items())))
    assert VerdictKey.of(reordered, NEW, "v26.7.0") == key            # the same policy, written in another order
    others = [VerdictKey.of({**POLICY, "maxUnavailable": 1}, NEW, "v26.7.0"), VerdictKey.of(POLICY, "580.82.07", "v26.7.0"),
              VerdictKey.of(POLICY, NEW, "v26.3.3"), VerdictKey.of(POLICY, NEW, None)]
    assert len({k.name for k in [key, *others]}) == 5
    assert key.name.startswith("gpucanary-verdict-") and len(key.name) == 38 and key.name.replace("-", "").isalnum()


def test_a_values_file_and_the_cluster_policy_it_renders_have_one_key(tmp_path: Path) -> None:
    """The shipped policies come as a CR; the same upgradePolicy in an NVIDIADriver is the same policy."""
    cr = load_policy(FIXTURES / "policies" / "default.yaml")
    driver = tmp_path / "nvidiadriver.yaml"
    driver.write_text("apiVersion: nvidia.com/v1alpha1\nkind: NVIDIADriver\nmetadata: {name: pool}\nspec:\n"
                      f"  upgradePolicy: {json.dumps(cr.to_cr())}\n")
    assert VerdictKey.of(load_policy(driver).to_cr(), NEW, "v26.7.0") == VerdictKey.of(cr.to_cr(), NEW, "v26.7.0")


def test_the_verdict_round_trips_through_its_configmap_data() -> None:
    passed, failed = verdict_of(clean_run()), verdict_of(field_note_run())
    assert passed.passed and passed.first_failed == "" and not failed.passed and failed.first_failed == "application"
    assert list(passed.stages) == ["rollout", "device", "network", "scheduler", "application"]
    for verdict in (passed, failed):
        data = verdict.data()
        assert all(isinstance(v, str) for v in data.values())
        assert Verdict.from_data(data) == verdict
    assert "failed at application" in failed.line() and "v26.7.0" in failed.line()


def test_the_metrics_are_prometheus_text_with_the_key_on_every_series() -> None:
    text = verdict_of(field_note_run()).exposition()
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples[0].startswith('gpucanary_verdict_passed{policy_digest="sha256:') and samples[0].endswith(" 0")
    assert all(f'target="{NEW}",release="v26.7.0"' in line for line in samples)
    assert any('stage="application",outcome="fail"} 1' in line for line in samples)
    assert f"gpucanary_verdict_finished_timestamp_seconds" in text and 'run_id="r1"' in text
    quoted = dataclasses.replace(verdict_of(clean_run()), key=VerdictKey("d", 'a"b\\c\nd', ""))
    assert 'target="a\\"b\\\\c\\nd"' in quoted.exposition()


def test_a_later_run_replaces_the_verdict_and_an_earlier_one_never_does() -> None:
    kube = FakeKube()
    first = verdict_of(clean_run())
    later = dataclasses.replace(verdict_of(field_note_run()), run_id="r2", finished_wall_ns=first.finished_wall_ns + 1)
    assert first.key == later.key
    assert publish.record(kube, first) and publish.read(kube, first.key) == first
    assert publish.record(kube, later) and publish.read(kube, first.key) == later
    assert not publish.record(kube, first)                  # finished before the one kept: left as it is
    assert publish.read(kube, first.key) == later
    labels = kube.get("v1", "ConfigMap", first.key.name, namespace=publish.NAMESPACE)["metadata"]["labels"]
    assert labels[publish.VERDICT_LABEL] == "fail"
    assert publish.read(kube, VerdictKey.of(POLICY, "999.0.0", "v26.7.0")) is None


def test_only_a_recent_pass_for_the_key_lets_the_rollout_go_on() -> None:
    passed, failed = verdict_of(clean_run()), verdict_of(field_note_run())
    at = lambda s: (lambda: passed.finished_wall_ns + int(s * 1e9))  # noqa: E731
    assert publish.refusal(passed, passed.key, max_age_s=3600, now_ns=at(3599)) is None
    assert "older than 1 h" in publish.refusal(passed, passed.key, max_age_s=3600, now_ns=at(3601))
    assert publish.refusal(failed, failed.key, max_age_s=3600, now_ns=at(1)).startswith("the canary failed: run r1")
    assert publish.refusal(None, passed.key, max_age_s=3600).startswith("no canary verdict for policy sha256:")


# --- a real Pushgateway (the `pushgateway` fixture of tests/conftest.py) -------------------------------

def scraped(url: str) -> list[str]:
    """The verdict series of this module's policy (the session's Pushgateway also holds other tests' pushes)."""
    digest = verdict_of(clean_run()).key.policy_digest
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        return [line for line in answer.read().decode().splitlines()
                if line.startswith("gpucanary_verdict_") and f'policy_digest="{digest}"' in line]

def test_the_pushgateway_keeps_the_last_push_of_each_key(pushgateway: str) -> None:
    passed = verdict_of(clean_run())
    publish.push(pushgateway, dataclasses.replace(passed, key=VerdictKey("sha256:another-policy", NEW, "v26.7.0")))
    publish.push(pushgateway, passed)
    lines = scraped(pushgateway)
    assert any(line.startswith("gpucanary_verdict_passed{") and 'job="gpucanary"' in line and line.endswith(" 1")
               for line in lines), lines
    failed = dataclasses.replace(verdict_of(field_note_run()), run_id="r2")
    publish.push(pushgateway, failed)
    lines = scraped(pushgateway)
    passed_lines = [line for line in lines if line.startswith("gpucanary_verdict_passed{")]
    assert len(passed_lines) == 1 and passed_lines[0].endswith(" 0"), lines     # replaced, not added
    assert not any('run_id="r1"' in line for line in lines) and any('run_id="r2"' in line for line in lines)
    other = dataclasses.replace(passed, key=VerdictKey.of(POLICY, "999.0.0", ""))     # an empty release, too
    publish.push(pushgateway, other)
    assert len([line for line in scraped(pushgateway) if line.startswith("gpucanary_verdict_passed{")]) == 2


def test_an_unreachable_pushgateway_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]      # nothing listens there once closed
    with pytest.raises(EnvError, match=rf"cannot push the verdict to the Pushgateway at http://127.0.0.1:{port} "):
        publish.push(f"http://127.0.0.1:{port}", verdict_of(clean_run()), timeout_s=2)


@pytest.mark.parametrize(("args", "line"), [
    ((), "gpucanary: error: a verdict is of one policy and one target driver; pass --gpucanary-policy PATH and "
         "--gpucanary-driver-version VERSION, as the canary run had"),
    ((f"--gpucanary-policy={FIXTURES / 'policies' / 'default.yaml'}", f"--gpucanary-driver-version={NEW}",
      "--max-age-h=-1"), "gpucanary: error: --max-age-h=-1.0 is not a positive number of hours; e.g. --max-age-h=24"),
])
def test_gpucanary_verdict_refuses_bad_input_in_one_line_before_reading_the_cluster(
        args: tuple[str, ...], line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUCANARY_POLICY", "GPUCANARY_DRIVER_VERSION"):
        monkeypatch.delenv(name, raising=False)
    assert main(["verdict", *args]) == 4
    assert capsys.readouterr().err.splitlines() == [line]
