"""The flight recorder over the in-memory apiserver: what the timeline file shows of a broken watch,
that it reads back unchanged, and that a waiter wakes on the change it waits for."""

from __future__ import annotations

import threading
from pathlib import Path

from kube_double import FakeKube

from pytest_gpucanary.canary import recorder
from pytest_gpucanary.canary.recorder import Recorder, StreamSpec
from pytest_gpucanary.gpu_operator import UPGRADE_STATE_LABEL
from pytest_gpucanary.kube.errors import Unavailable


def nodes(*names: str) -> FakeKube:
    fake = FakeKube()
    for name in names:
        fake.create({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": name, "labels": {UPGRADE_STATE_LABEL: "upgrade-done"}}, "spec": {}})
    return fake


def state_seen(node: str, state: str):
    return lambda records: True if any(r.type == "MODIFIED" and r.name == node
                                       and r.object["metadata"]["labels"].get(UPGRADE_STATE_LABEL) == state
                                       for r in records) else None


def test_a_broken_watch_shows_in_the_timeline_as_an_error_and_a_relist(tmp_path: Path) -> None:
    fake = nodes("canary-0", "gpu-1")
    fake.fail_watch("Node", Unavailable("watch Node: cannot reach the apiserver (ProtocolError)"))
    path = tmp_path / "timeline.jsonl"
    stream = StreamSpec("node-canary-0", "v1", "Node", field_selector="metadata.name=canary-0")

    with Recorder(fake, path, [stream]) as rec:
        rec.wait_for(lambda rs: True if sum(r.type == "RELISTED" for r in rs) == 2 else None, timeout_s=10)
        fake.patch("v1", "Node", "gpu-1", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "cordon-required"}}})
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "cordon-required"}}})
        rec.wait_for(state_seen("canary-0", "cordon-required"), timeout_s=10)
        recorded = list(rec.records)

    written = recorder.load(path)
    assert [(r.type, r.name) for r in written] == [
        ("RELISTED", None), ("LISTED", "canary-0"), ("WATCH_ERROR", None),
        ("RELISTED", None), ("LISTED", "canary-0"), ("MODIFIED", "canary-0")]   # gpu-1 is not this stream's
    assert written == recorded
    assert "cannot reach the apiserver" in written[2].object["message"]
    assert written[0].object == {"count": 1} and written[0].stream == "node-canary-0"
    assert written[-1].object["metadata"]["labels"][UPGRADE_STATE_LABEL] == "cordon-required"
    assert [r.received_mono_ns for r in written] == sorted(r.received_mono_ns for r in written)


def test_wait_for_wakes_on_the_change_it_waits_for(tmp_path: Path) -> None:
    fake = nodes("canary-0")
    stream = StreamSpec("node-canary-0", "v1", "Node", field_selector="metadata.name=canary-0")
    rec = Recorder(fake, tmp_path / "timeline.jsonl", [stream])
    rec._changed = wakes = _Wakes()

    def change() -> None:       # once the waiter waits
        wakes.waiting.wait(timeout=30)
        fake.patch("v1", "Node", "canary-0", {"metadata": {"labels": {UPGRADE_STATE_LABEL: "upgrade-required"}}})

    with rec:
        rec.wait_for(lambda rs: True if rs else None, timeout_s=5)
        wakes.waiting.clear()
        wakes.woken.clear()
        changer = threading.Thread(target=change)
        changer.start()
        rec.wait_for(state_seen("canary-0", "upgrade-required"), timeout_s=30)
    changer.join()

    # the waiter also re-checks on its own every 5 s; the wait that ended with the change seen was woken by the
    # record, not ended by that bound
    assert wakes.woken and wakes.woken[-1] is True, wakes.woken


class _Wakes(threading.Condition):
    """The recorder's condition, noting for each wait whether it was woken (True) or ran out its time (False)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.woken: list[bool] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        woken = super().wait(timeout)
        self.woken.append(woken)
        return woken


def test_an_event_for_an_object_never_listed_is_recorded_as_the_server_sent_it(tmp_path: Path) -> None:
    """A watch may deliver the deletion of a pod the list never showed (created and gone in between)."""
    fake = nodes("canary-0")
    stream = StreamSpec("pods-canary-0", "v1", "Pod", field_selector="spec.nodeName=canary-0")
    gone = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe-x", "namespace": "gpucanary-r1"},
            "spec": {"nodeName": "canary-0", "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                     "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}

    with Recorder(fake, tmp_path / "timeline.jsonl", [stream]) as rec:
        rec.wait_for(lambda rs: True if rs else None, timeout_s=5)
        fake.emit("v1", "Pod", "DELETED", gone)
        deleted = rec.wait_for(lambda rs: next((r for r in rs if r.type == "DELETED"), None), timeout_s=5)

    assert (deleted.namespace, deleted.name) == ("gpucanary-r1", "probe-x")
    assert deleted.object["spec"] == {"nodeName": "canary-0", "gpus": 1, "emptyDirs": ["shm"]}
    assert fake.objects().keys() == {("v1", "Node", None, "canary-0")}


def test_a_pod_that_gets_the_gpus_without_asking_keeps_why_in_its_trimmed_spec() -> None:
    pod = {"metadata": {"name": "agent"}, "spec": {"nodeName": "n", "runtimeClassName": "nvidia",
                                                   "containers": [{"name": "c", "image": "x"}]}}
    assert recorder.trim("Pod", pod)["spec"] == {"nodeName": "n", "gpus": 0, "emptyDirs": [],
                                                 "holdsDriver": "runtimeClassName nvidia"}


def test_an_operator_pod_not_yet_bound_is_recorded_apart_with_the_node_its_daemonset_made_it_for(
        tmp_path: Path) -> None:
    fake = nodes("canary-0")
    pinned = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["canary-0"]}]}]}}}
    for name, node in (("driver-pending", None), ("driver-bound", "canary-0")):
        fake.create({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": name, "namespace": "gpu-operator",
                                  "ownerReferences": [{"kind": "DaemonSet", "name": "nvidia-driver-daemonset"}]},
                     "spec": {**({"nodeName": node} if node else {}), "affinity": pinned,
                              "containers": [{"name": "c", "image": "x"}]}})
    stream = StreamSpec("unbound-operator-pods", "v1", "Pod", namespace="gpu-operator",
                        field_selector="spec.nodeName=", recorded_as="UnboundPod")

    with Recorder(fake, tmp_path / "timeline.jsonl", [stream]) as rec:
        listed = rec.wait_for(lambda rs: [r for r in rs if r.type == "LISTED"] or None, timeout_s=5)

    assert [(r.kind, r.name) for r in listed] == [("UnboundPod", "driver-pending")]
    assert listed[0].object["spec"]["daemonSetNode"] == "canary-0"
    bound = fake.get("v1", "Pod", "driver-bound", namespace="gpu-operator")
    assert "daemonSetNode" not in recorder.trim("Pod", bound)["spec"]
