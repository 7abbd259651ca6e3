"""Read-only checks before any write: what the target cluster's GPU Operator looks like (which mode it
runs, where, whether NVIDIADrivers carry their own upgrade policy), every permission the run needs
(SelfSubjectAccessReviews), the pool's eligibility, and the service and Prometheus answering with the
series the metric checks read. Never changes the cluster; every problem found is one line.

`PERMISSIONS` is the run's, cleanup's and preflight's whole need of the API; deploy/rbac.yaml grants
exactly these (a unit test holds the two equal) and the local fleet's e2e runs a gate under it.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pytest_gpucanary import gpu_operator as op
from pytest_gpucanary.canary import dra, metrics, neighbours
from pytest_gpucanary.canary.lease import CLUSTER_LOCK_NAMESPACE, LEASE_NAME
from pytest_gpucanary.canary.publish import NAMESPACE as VERDICT_NAMESPACE
from pytest_gpucanary.canary.workloads import PRIORITY_CLASS
from pytest_gpucanary.cluster import ClusterInfo, discover
from pytest_gpucanary.errors import ConfigError, EnvError, GpucanaryError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import Forbidden, NotFound
from pytest_gpucanary.safe_text import redact_url

if TYPE_CHECKING:
    from pytest_gpucanary.canary.pool import PoolProvider

RBAC_FILE = "deploy/rbac.yaml"
RBAC_CLUSTER_POLICY_FILE = "deploy/rbac-clusterpolicy-mode.yaml"
# deploy/admission.yaml's policies, each bound under its own name
ADMISSION_POLICIES = (
    "gpucanary-namespaces",
    "gpucanary-namespaced-writes",
    "gpucanary-pods",
    "gpucanary-services",
    "gpucanary-claims",
    "gpucanary-nodes",
    "gpucanary-driver-policy",
    "gpucanary-driver-handover",
)
CHART_CLUSTER_POLICY = "cluster-policy"  # the ClusterPolicy's name as the operator's chart creates it


@dataclass(frozen=True)
class Permission:
    """One verb on one resource, where the run needs it: `cluster` (cluster-scoped kinds, or namespaced
    kinds in every namespace: the run's namespaces do not exist before it runs, so no Role can name
    them; deploy/admission.yaml pins those writes to them), `operator` (the GPU Operator's namespace;
    ClusterPolicy mode only) or `verdicts` (the canary's own namespace, where verdicts are kept).
    `writes_cluster_policy`: only runs that write the ClusterPolicy need it (deploy/rbac-clusterpolicy-mode.yaml)."""

    verb: str
    resource: str  # plural; `kind/sub` for a subresource
    group: str = ""
    why: str = ""
    scope: str = "cluster"
    name: str = ""  # a resourceName the rule is limited to
    writes_cluster_policy: bool = False

    @property
    def file(self) -> str:
        return RBAC_CLUSTER_POLICY_FILE if self.writes_cluster_policy else RBAC_FILE

    def text(self) -> str:
        where = {"operator": " in the operator's namespace", "verdicts": f" in namespace {VERDICT_NAMESPACE}"}.get(
            self.scope, ""
        )
        named = f" {self.name}" if self.name else ""
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''}{named}{where}"


def _perms(
    verbs: str,
    resource: str,
    group: str = "",
    *,
    why: str,
    scope: str = "cluster",
    name: str = "",
    writes_cluster_policy: bool = False,
) -> tuple[Permission, ...]:
    return tuple(Permission(verb, resource, group, why, scope, name, writes_cluster_policy) for verb in verbs.split())


PERMISSIONS: tuple[Permission, ...] = (
    *_perms("get list", "clusterpolicies", "nvidia.com", why="read the operator's mode"),
    *_perms("list", "gpuclusters", "nvidia.com", why="read the operator's mode (GPUCluster, v26.7)"),
    *_perms(
        "patch",
        "clusterpolicies",
        "nvidia.com",
        name=CHART_CLUSTER_POLICY,
        writes_cluster_policy=True,
        why="apply and restore the policy (ClusterPolicy mode; NVIDIADriver mode before operator v26.7)",
    ),
    *_perms("get list patch", "nvidiadrivers", "nvidia.com", why="find the pool's NVIDIADriver; set its version"),
    *_perms(
        "create delete",
        "nvidiadrivers",
        "nvidia.com",
        why="hand a node of the default NVIDIADriver to the run's own and back",
    ),
    *_perms(
        "get",
        "customresourcedefinitions",
        "apiextensions.k8s.io",
        name=op.NVIDIADRIVER_CRD,
        why="tell whether NVIDIADrivers carry their own upgradePolicy",
    ),
    *_perms(
        "get",
        "priorityclasses",
        "scheduling.k8s.io",
        name=PRIORITY_CLASS,
        why="check that the canary pods' PriorityClass is installed",
    ),
    *_perms("get list watch patch", "nodes", why="carve out, record, hold back and restore GPU nodes"),
    *_perms("list watch", "pods", why="find the operator's pods; record every pod on the pool"),
    *_perms(
        "create delete",
        "pods",
        why="pull each workload image on the pool node; the collective probe's ranks; "
        "a pool node's driver pod the scheduler could not place",
    ),
    *_perms(
        "get",
        "pods/log",
        why="the collective probe's rank 0 output, when it left no termination message; "
        "a crash-looping operand's last words",
    ),
    *_perms("list watch", "events", why="record the upgrade's events"),
    *_perms("create delete list watch", "namespaces", why="the run's own namespaces, found again by cleanup"),
    *_perms("get", "namespaces", name=CLUSTER_LOCK_NAMESPACE, why="the ClusterPolicy lock's holder"),
    *_perms("create", "leases", "coordination.k8s.io", why="say the run is alive"),
    *_perms("get patch", "leases", "coordination.k8s.io", name=LEASE_NAME, why="say the run is alive"),
    *_perms("list watch", "serviceaccounts", why="wait for the run namespace's default ServiceAccount"),
    *_perms("create list watch", "jobs", "batch", why="the GPU job and the start probes"),
    *_perms("create", "deployments", "apps", why="the non-GPU service"),
    *_perms("create", "services", why="the non-GPU service"),
    *_perms("create", "poddisruptionbudgets", "policy", why="the non-GPU service's budget"),
    *_perms("list watch", "poddisruptionbudgets", "policy", why="name the budget that refuses an eviction on the pool"),
    *_perms(
        "list watch",
        "resourceslices",
        "resource.k8s.io",
        why="say which nodes offer GPUs through DRA and record the pool's slices across the swap (where served)",
    ),
    *_perms(
        "create",
        "resourceclaimtemplates",
        "resource.k8s.io",
        why="the GPU job's claim on a pool whose nodes offer their GPUs through DRA",
    ),
    *_perms(
        "get", "resourceclaims", "resource.k8s.io", why="count the GPUs a pod on the pool holds through DRA claims"
    ),
    *_perms(
        "list watch",
        "nodemaintenances",
        "maintenance.nvidia.com",
        why="record a NodeMaintenance that another system puts on the pool (where the kind is served)",
    ),
    *(
        perm
        for name in ADMISSION_POLICIES
        for kind in ("validatingadmissionpolicies", "validatingadmissionpolicybindings")
        for perm in _perms(
            "get",
            kind,
            "admissionregistration.k8s.io",
            name=name,
            why="say whether the apiserver enforces deploy/admission.yaml",
        )
    ),
    *_perms(
        "list watch",
        "daemonsets",
        "apps",
        scope="operator",
        writes_cluster_policy=True,
        why="wait for the driver DaemonSets on restore",
    ),
    *_perms("get create patch", "configmaps", scope="verdicts", why="record the run's verdict"),
)


@dataclass(frozen=True)
class Problem:
    line: str
    usage: bool = False  # the user's input (exit 4), not the environment (exit 6)


@dataclass(frozen=True)
class PreflightReport:
    """What the read-only checks found: problems (one line each), notes, and what the run will expose."""

    cluster: ClusterInfo | None
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    exposure: tuple[str, ...] = ()
    checked: tuple[str, ...] = field(default=())
    dra_note: str = ""  # the cluster's nodes that offer GPUs through DRA, which a run on another pool does not prove

    @property
    def unproven(self) -> tuple[str, ...]:
        """What a passing run here does not speak for, one line each."""
        return (self.dra_note,) if self.dra_note else ()

    def raise_first(self) -> None:
        """The first problem as the run's error (all of them are in `problems`)."""
        if not self.problems:
            return
        first = self.problems[0]
        more = (
            f" (and {len(self.problems) - 1} more: `gpucanary preflight` lists them)" if len(self.problems) > 1 else ""
        )
        raise (ConfigError if first.usage else EnvError)(first.line + more)


def missing_permissions(kube: Kube, permissions: Iterable[Permission], cluster: ClusterInfo) -> list[Problem]:
    problems = []
    for perm in permissions:
        if (perm.scope == "operator" and cluster.nvidiadriver_mode) or (
            perm.writes_cluster_policy and not cluster.writes_cluster_policy
        ):
            continue
        namespace = {"operator": cluster.operator_namespace, "verdicts": VERDICT_NAMESPACE}.get(perm.scope)
        name = cluster.cluster_policy if perm.name == CHART_CLUSTER_POLICY else perm.name
        if not kube.can_i(perm.verb, perm.resource, group=perm.group, namespace=namespace, name=name or None):
            problems.append(
                Problem(f"missing permission: {perm.text()} (to {perm.why}); grant the rules of {perm.file}")
            )
    return problems


def exposure(
    cluster: ClusterInfo, *, pool_nodes: Iterable[str] = (), target: str = "", held: Iterable[str] | None = None
) -> tuple[str, ...]:
    """What the run changes beyond its pool, one line each; nothing in NVIDIADriver mode with a per-driver
    upgradePolicy (operator v26.7+), where only the pool's own NVIDIADriver changes."""
    if cluster.nvidiadriver_mode and cluster.per_driver_policy:
        return ()
    if cluster.nvidiadriver_mode:
        return (
            f"NVIDIADriver mode without a per-driver upgradePolicy (operator before v26.7): for the run's "
            f"duration the policy under test is ClusterPolicy {cluster.cluster_policy}'s upgradePolicy, read for "
            "every NVIDIADriver's nodes; the version changes on the pool's NVIDIADriver only",
        )
    pool = set(pool_nodes)
    others = sorted(held) if held is not None else [n for n in cluster.gpu_nodes if n not in pool]
    names = ", ".join(others[:10]) + (f" and {len(others) - 10} more" if len(others) > 10 else "")
    return (
        f"ClusterPolicy mode: for the run's duration the cluster-wide driver version in ClusterPolicy "
        f"{cluster.cluster_policy} is {target or 'the target'}, and its upgradePolicy the policy under test",
        f"held back by the skip label {op.SKIP_LABEL}=true for the run's duration: {len(others)} GPU node(s)"
        + (f": {names}" if others else ""),
        "recommended: NVIDIADriver mode (spec.driver.useNvidiaDriverCRD: true) with an NVIDIADriver for the "
        "canary pool alone, so a run touches nothing beyond its pool",
    )


def admission_note(kube: Kube) -> str:
    """Whether the apiserver itself holds the canary to its own objects (deploy/admission.yaml): a note, since
    clusters before Kubernetes 1.30 have no ValidatingAdmissionPolicy and RBAC alone still limits the verbs."""
    missing = []
    for name in ADMISSION_POLICIES:
        for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            try:
                kube.get("admissionregistration.k8s.io/v1", kind, name)
            except (NotFound, Forbidden):
                missing.append(f"{kind} {name}")
    if not missing:
        return f"the apiserver enforces deploy/admission.yaml ({len(ADMISSION_POLICIES)} policies, bound)"
    return (
        f"the apiserver does not enforce deploy/admission.yaml ({len(missing)} of {2 * len(ADMISSION_POLICIES)} "
        f"objects missing, e.g. {missing[0]}): "
        "apply it, so that a stolen token can do no more than a run does"
    )


def answers_http(url: str, *, timeout_s: float = 5.0) -> str | None:
    """None when something answers HTTP at `url` (any status: the run's own service does not exist yet),
    else why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as err:
        return str(getattr(err, "reason", err))[:120]


def priority_class_problem(kube: Kube) -> str | None:
    try:
        kube.get("scheduling.k8s.io/v1", "PriorityClass", PRIORITY_CLASS)
        return None
    except NotFound:
        return (
            f"PriorityClass {PRIORITY_CLASS} is not installed: every canary pod runs at it, below tenants and "
            "never preempting them; kubectl apply -f deploy/priorityclass.yaml"
        )
    except GpucanaryError as err:
        return f"cannot read PriorityClass {PRIORITY_CLASS} ({err})"


def token_life_problem(kube: Kube, longest_run_s: float) -> str:
    """A static token that expires before a run's worst case ends; exec-plugin tokens are asked for again."""
    if kube.token_expires is None:
        return ""
    left_s = (kube.token_expires - datetime.now(UTC)).total_seconds()
    if left_s >= longest_run_s:
        return ""
    return (
        f"the kubeconfig's token expires in {max(left_s, 0) // 60:.0f} min, before a run with these options may "
        f"end (up to {math.ceil(longest_run_s / 60)} min): mint one that lives longer, or use an exec credential "
        "plugin"
    )


def check(
    kube: Kube,
    provider: PoolProvider,
    *,
    target: str,
    prometheus_url: str | None,
    service_url: str | None,
    longest_run_s: float | None = None,
    pushgateway_url: str | None = None,
) -> PreflightReport:
    """Every read-only check, each problem one line; nothing is written. With `longest_run_s`, a static
    token that ends before a run could is a problem (a restore cut off by its own credentials)."""
    try:
        cluster = discover(kube)
    except GpucanaryError as err:
        return PreflightReport(None, (Problem(str(err), isinstance(err, ConfigError)),))
    problems = missing_permissions(kube, (*PERMISSIONS, *getattr(provider, "permissions", ())), cluster)
    try:
        provider.check(kube, cluster)
    except GpucanaryError as err:
        problems.append(Problem(str(err), isinstance(err, ConfigError)))
    if problem := priority_class_problem(kube):
        problems.append(Problem(problem))
    notes = [admission_note(kube), *neighbours.detect(kube).notes()]
    dra_nodes = dra.gpu_nodes(kube)
    dra_note = dra.note(dra_nodes, cluster.operator_release) if dra_nodes else ""
    if service_url and (why := answers_http(service_url)):
        problems.append(Problem(f"service URL {redact_url(service_url)} does not answer ({why})"))
    if pushgateway_url and (why := answers_http(pushgateway_url)):
        problems.append(Problem(f"Pushgateway {redact_url(pushgateway_url)} does not answer ({why})"))
    if prometheus_url:
        problems += [Problem(line) for line in metrics.missing_series(prometheus_url)]
    else:
        notes.append("no Prometheus URL: the metric checks will not run")
    if longest_run_s:
        notes.append(
            f"a run with these options can take up to {math.ceil(longest_run_s / 60)} min (image pulls, baseline, "
            "the upgrade budget for the rollout and again for the restore)"
        )
        if problem := token_life_problem(kube, longest_run_s):
            problems.append(Problem(problem))
    return PreflightReport(cluster, tuple(problems), tuple(notes), exposure(cluster, target=target), dra_note=dra_note)
