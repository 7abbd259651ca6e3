"""The stage a run sets before the change: its namespace, the workload images pulled on the pool node, the
recorder's streams, and the workloads placed and seen running. Every object it creates lives in the run's own
namespace, so deleting that namespace takes them off again.
"""

from __future__ import annotations

import contextlib
import functools

from pytest_gpucanary.canary import claims, dra, neighbours, workloads
from pytest_gpucanary.canary.measures import Measured
from pytest_gpucanary.canary.pool import Pool
from pytest_gpucanary.canary.recorder import Recorder, StreamSpec
from pytest_gpucanary.config import Settings, flag
from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.kube import Kube
from pytest_gpucanary.kube.errors import NotFound
from pytest_gpucanary.kube.ownership import owned_namespace
from pytest_gpucanary.ladder import WorkloadRef
from pytest_gpucanary.ladder.cause import UNBOUND_POD
from pytest_gpucanary.ladder.index import TimelineIndex
from pytest_gpucanary.progress import ProgressLine

WORKLOAD_READY_TIMEOUT_S = 180


class RunStage:
    """The setting-up steps of `CanaryRun`, on its settings, cluster and progress line."""

    settings: Settings
    kube: Kube
    progress: ProgressLine

    def _create_namespace(
        self, placement: workloads.Placement, placed: list[dict], cleanup: contextlib.ExitStack
    ) -> None:
        settings = self.settings
        may_place = [
            *placed,
            workloads.collective_pod(
                settings.collective_probe,
                placement,
                when="check",
                rank=0,
                node=placement.node,
                master_addr="",
                images=settings.images(),
            ),
        ]
        self.kube.create(
            owned_namespace(placement.namespace, placement.run_id, pod_security=workloads.pod_security(may_place))
        )
        cleanup.callback(self._delete_quietly, "v1", "Namespace", placement.namespace)
        self.kube.wait_for(
            "v1", "ServiceAccount", "default", lambda sa: True, namespace=placement.namespace, timeout_s=60
        )

    def _delete_quietly(self, api_version: str, kind: str, name: str, *, namespace: str | None = None) -> None:
        with contextlib.suppress(NotFound):
            self.kube.delete(api_version, kind, name, namespace=namespace)

    def _pull_images(self, placement: workloads.Placement, placed: list[dict]) -> None:
        """Before the policy is touched: every workload image pulled on the pool node by a short pod of the
        run's own; one that cannot be pulled (a missing tag, an unreachable registry) stops the run."""
        images = workloads.images_of(placed)
        timeout_s = self.settings.image_pull_timeout_s
        self.progress.line(f"pulling {len(images)} image(s) on {placement.node}: {', '.join(images)}")
        pods = [workloads.image_pull_pod(image, placement, index=i) for i, image in enumerate(images)]
        for pod in pods:
            self.kube.create(pod)

        def settled(seen: dict[str, dict]) -> dict[str, tuple[bool | None, str]] | None:
            states = {p["spec"]["containers"][0]["image"]: workloads.pull_state(p) for p in seen.values()}
            if any(ok is False for ok, _ in states.values()) or (
                len(states) == len(images) and all(ok for ok, _ in states.values())
            ):
                return states
            return None

        try:
            states = self.kube.watch_until(
                "v1",
                "Pod",
                settled,
                timeout_s=timeout_s,
                namespace=placement.namespace,
                label_selector=f"{workloads.ROLE_LABEL}={workloads.IMAGE_PULL_ROLE}",
            )
        except TimeoutError as err:
            raise EnvError(
                f"the workload images were not all pulled on {placement.node} within {timeout_s:.0f} s ({err})",
                hint=f"mirror them ({flag('image_registry')}) or raise {flag('image_pull_timeout_s')}",
            ) from None
        for image, (ok, why) in states.items():
            if ok is False:
                raise EnvError(
                    f"image {image} cannot be pulled on {placement.node}: {why}",
                    hint=f"publish or mirror it, then pass {flag('image_registry')} or the image's own "
                    "--gpucanary-*-image option",
                )
        for pod in pods:
            self._delete_quietly("v1", "Pod", pod["metadata"]["name"], namespace=placement.namespace)
        self.progress.line(f"images pulled on {placement.node}")

    def _streams(self, pool: Pool, placement: workloads.Placement, operator_namespace: str) -> list[StreamSpec]:
        streams = [
            StreamSpec("canary-pods", "v1", "Pod", namespace=placement.namespace),
            # an operand the scheduler cannot place on the pool has no node yet (the pools' streams miss it)
            StreamSpec(
                "unbound-operator-pods",
                "v1",
                "Pod",
                namespace=operator_namespace,
                field_selector="spec.nodeName=",
                recorded_as=UNBOUND_POD,
            ),
            StreamSpec("canary-events", "v1", "Event", namespace=placement.namespace),
            StreamSpec(
                "canary-jobs",
                "batch/v1",
                "Job",
                namespace=placement.namespace,
                label_selector=f"{workloads.ROLE_LABEL}=gpu-job",
            ),
            # which budget refuses an eviction on the pool: any namespace's pods can be there
            StreamSpec("budgets", "policy/v1", "PodDisruptionBudget"),
        ]
        if neighbours.node_maintenance_served(self.kube):  # the maintenance operator may cordon and drain the pool
            streams.append(StreamSpec("node-maintenance", *neighbours.NODE_MAINTENANCE))
        streams += dra.slice_streams(self.kube, pool.nodes)
        for node in pool.nodes:
            streams += [
                StreamSpec(f"node-{node}", "v1", "Node", field_selector=f"metadata.name={node}"),
                StreamSpec(f"pods-{node}", "v1", "Pod", field_selector=f"spec.nodeName={node}"),
                StreamSpec(
                    f"events-{node}",
                    "v1",
                    "Event",
                    namespace="default",
                    field_selector=f"involvedObject.kind=Node,involvedObject.name={node}",
                ),
            ]
        return streams

    def _place_workloads(self, placement: workloads.Placement, run: Measured, recorder: Recorder) -> None:
        settings = self.settings
        images = settings.images()
        job = workloads.gpu_job(settings.gpu_job, placement, duration_s=settings.job_duration_s, images=images)
        if dra.offer_gpus(self.kube, run.pool.nodes):
            job = self._claim_through_dra(job, placement, run)
        run.gpu_job_until_wall_ns = int((workloads.work_until_wall_s(job) or 0) * 1e9)
        created = self.kube.create(job)
        run.gpu_job = WorkloadRef(placement.namespace, job["metadata"]["name"], created["metadata"]["uid"])
        for manifest in workloads.service(settings.service or run.pool.service, placement, images=images):
            self.kube.create(manifest)
            if manifest["kind"] == "Deployment":
                run.service = WorkloadRef(placement.namespace, manifest["metadata"]["name"])
        holders = workloads.holder(settings.holder, placement, images=images) if settings.holder else []
        for manifest in holders:
            self.kube.create(manifest)
        held = f", driver holder {', '.join(m['metadata']['name'] for m in holders)}" if holders else ""
        self.progress.line(
            f"workloads placed on {placement.node}: job {job['metadata']['name']}, "
            f"service {run.service.name}{held}; waiting for them to run"
        )
        for role in ("gpu-job", "service", *((workloads.HOLDER_ROLE,) if holders else ())):
            recorder.wait_for(
                functools.partial(_running, namespace=placement.namespace, role=role),
                timeout_s=WORKLOAD_READY_TIMEOUT_S,
                what=f"the {role} pod Running on {placement.node}",
            )

    def _claim_through_dra(self, job: dict, placement: workloads.Placement, run: Measured) -> dict:
        """The GPU job claiming its GPUs through DRA, as the pool's own pods do, from templates made in the run's
        namespace: the run then speaks for claim-holding pods, and says so instead of what it would not prove."""
        job, counts = claims.claiming(job)
        made = [claims.template(count, placement.namespace, placement.run_id) for count in sorted(counts)]
        for template in made:
            self.kube.create(template)
        run.gpu_claims = (
            f"the GPU job claims its GPUs through DRA, as the pool offers them ({dra.GPU_DRIVER} ResourceSlices): "
            f"ResourceClaimTemplate {', '.join(t['metadata']['name'] for t in made)}, "
            f"device class {claims.DEVICE_CLASS}"
        )
        self.progress.line(f"pool: {run.gpu_claims}")
        run.dra_note = ""
        return job


def _running(index: TimelineIndex, namespace: str, role: str, *, finished_ok: bool = False) -> bool | None:
    phases = ("Running", "Succeeded") if finished_ok else ("Running",)
    pods = index.live_pods(namespace=namespace, label=(workloads.ROLE_LABEL, role))
    return True if any(p.phase in phases for p in pods) else None
