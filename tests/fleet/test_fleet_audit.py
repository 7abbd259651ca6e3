"""The fleet's audit-log reader on canned apiserver lines (the format of audit.k8s.io/v1 events)."""

from __future__ import annotations

import json
from pathlib import Path

from testbed.audit import AuditRecord, RunScope, Scope, outside, read_log, select


def event(audit_id: str, verb: str, *, ua: str = "gpucanary/0.1.0", stage: str = "ResponseComplete",
          resource: str = "", name: str = "", namespace: str = "", group: str = "", sub: str = "",
          code: int = 200, at: str = "2026-11-30T12:00:00.000001Z") -> str:
    ref = {k: v for k, v in {"resource": resource, "name": name, "namespace": namespace, "apiGroup": group,
                             "subresource": sub}.items() if v}
    body = {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "auditID": audit_id,
            "stage": stage, "requestURI": f"/x/{audit_id}", "verb": verb, "userAgent": ua,
            "requestReceivedTimestamp": at, "stageTimestamp": at}
    if ref:
        body["objectRef"] = ref
    if stage == "ResponseComplete":
        body["responseStatus"] = {"metadata": {}, "code": code}
    return json.dumps(body, separators=(",", ":"))  # the apiserver writes compact JSON


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_watch_is_one_record_with_its_latest_stage(tmp_path: Path) -> None:
    log = write(tmp_path / "audit.log",
                event("w1", "watch", resource="pods", namespace="ns", stage="ResponseStarted"),
                event("w1", "watch", resource="pods", namespace="ns"))
    [record] = read_log(log)
    assert record.stage == "ResponseComplete" and record.code == 200 and record.is_watch


def test_user_agent_and_window_filter_and_microsecond_timestamps(tmp_path: Path) -> None:
    log = write(tmp_path / "audit.log",
                event("a", "get", at="2026-11-30T12:00:00.000001Z"),
                event("b", "get", ua="kubectl/v1.36.3 (linux/amd64)", at="2026-11-30T12:00:01Z"),
                event("c", "list", at="2026-11-30T12:00:02.500000Z"),
                "{not json, a line cut by a crash")
    everything = read_log(log)
    assert [r.audit_id for r in everything] == ["a", "b", "c"]
    ours = read_log(log, user_agent_prefix="gpucanary/")
    assert [r.audit_id for r in ours] == ["a", "c"]
    assert round(ours[1].received_s - ours[0].received_s, 6) == 2.499999  # float seconds keep µs near 2026
    assert [r.audit_id for r in select(ours, since_s=ours[0].received_s + 1e-6)] == ["c"]
    assert [r.audit_id for r in read_log(log, until_s=ours[0].received_s)] == ["a"]


def test_rotated_files_are_read_oldest_first(tmp_path: Path) -> None:
    write(tmp_path / "audit-2026-11-30T11-00-00.000.log", event("old", "get", at="2026-11-30T11:00:00Z"))
    log = write(tmp_path / "audit.log", event("new", "get", at="2026-11-30T12:00:00Z"))
    assert [r.audit_id for r in read_log(log)] == ["old", "new"]


def records(*lines: str, tmp_path: Path) -> list[AuditRecord]:
    return read_log(write(tmp_path / "audit.log", *lines))


def test_scope_sorts_writes_by_what_the_run_owns(tmp_path: Path) -> None:
    run = RunScope("r1", frozenset({"canary-r1-0"}))
    got = records(
        event("ns", "create", resource="namespaces", name="gpucanary-r1"),
        event("pod", "create", resource="pods", namespace="gpucanary-r1", name="p"),
        event("evict", "create", resource="pods", sub="eviction", namespace="gpucanary-r1", name="p"),
        event("node", "create", resource="nodes", name="canary-r1-0"),
        event("drv", "create", resource="nvidiadrivers", group="nvidia.com", name="canary-r1"),
        event("drv-patch", "patch", resource="nvidiadrivers", group="nvidia.com", name="canary-r1"),
        event("cp", "patch", resource="clusterpolicies", group="nvidia.com", name="cluster-policy"),
        event("skip", "patch", resource="nodes", name="gpu-node-3"),
        event("foreign", "delete", resource="configmaps", namespace="default", name="x"),
        event("refused", "create", resource="configmaps", namespace="default", name="y", code=403),
        event("verdict", "patch", resource="configmaps", namespace="gpucanary", name="gpucanary-verdict-0123"),
        event("not-a-verdict", "patch", resource="configmaps", namespace="gpucanary", name="kube-root-ca.crt"),
        event("nodes", "list", resource="nodes"),
        tmp_path=tmp_path)
    run = run.with_creates(got)
    scopes = {r.audit_id: run.scope_of(r) for r in got}
    assert scopes == {"ns": Scope.OWN_NAMESPACE, "pod": Scope.OWN_NAMESPACE, "evict": Scope.OWN_NAMESPACE,
                      "node": Scope.POOL_NODE, "drv": Scope.OWN_OBJECT, "drv-patch": Scope.OWN_OBJECT,
                      "cp": Scope.POLICY, "skip": Scope.OTHER_NODE, "foreign": Scope.CLUSTER,
                      "refused": Scope.CLUSTER, "verdict": Scope.VERDICT, "not-a-verdict": Scope.CLUSTER,
                      "nodes": Scope.CLUSTER}
    assert [r.audit_id for r in outside(got, run)] == ["skip", "foreign", "refused", "not-a-verdict"]
    assert got[2].kind_key == "pods/eviction" and got[4].kind_key == "nvidiadrivers.nvidia.com"


def test_the_lease_namespace_is_the_runs_own() -> None:
    from testbed.audit import AuditRecord, RunScope, Scope, outside

    def write(namespace: str, name: str) -> AuditRecord:
        return AuditRecord("id-" + name, "ResponseComplete", "delete", "gpucanary/0", "/api/v1/namespaces/" + name, "",
                           "namespaces", "", namespace, name, 200, 0.0, 0.0)
    scope = RunScope("r1", frozenset())
    assert scope.scope_of(write("gpucanary-r1-owner", "gpucanary-r1-owner")) == Scope.OWN_NAMESPACE
    assert outside([write("gpucanary-r2-owner", "gpucanary-r2-owner")], scope)


def test_a_phase_is_read_from_an_object_body_and_a_json_patch_body_is_kept_whole(tmp_path: Path) -> None:
    status_write = json.loads(event("s", "update", resource="pods", sub="status", name="p"))
    status_write["requestObject"] = {"kind": "Pod", "status": {"phase": "Failed"}}
    json_patch = json.loads(event("j", "patch", resource="pods", sub="status", name="p"))
    json_patch["requestObject"] = [{"op": "replace", "path": "/status/phase", "value": "Running"}]
    log = write(tmp_path / "audit.log", json.dumps(status_write), json.dumps(json_patch))
    written, patched = read_log(log)
    assert written.sets_phase == "Failed"
    assert patched.sets_phase == "" and patched.request_object == json_patch["requestObject"]
