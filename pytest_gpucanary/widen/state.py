"""The sweep's record: what it rolls out, where, its waves and how each went. Kept in a ConfigMap in the
canary's namespace, one per verdict key, so a killed `widen` is resumed from the cluster. Pure data."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pytest_gpucanary.receipt.verdict import VerdictKey

CONFIGMAP_PREFIX = "gpucanary-widen-"

PENDING, ROLLING, SOAKING, PASSED, FAILED = "pending", "rolling", "soaking", "passed", "failed"
RUNNING, HALTED, DONE, ROLLED_BACK = "running", "halted", "done", "rolled-back"


def configmap_name(key: VerdictKey) -> str:
    return CONFIGMAP_PREFIX + key.name.rsplit("-", 1)[-1]


@dataclass
class Disruption:
    """A pod removed from a wave's node while the wave ran."""

    node: str
    namespace: str
    name: str
    gpus: int
    allowed: bool
    wall_ns: int
    how: str  # "deleted", or the reason the kubelet gave (Evicted)

    def line(self) -> str:
        kind = f"GPU pod ({self.gpus} GPUs)" if self.gpus else "pod that uses no GPU"
        return f"{kind} {self.namespace}/{self.name} {self.how} on {self.node}"


@dataclass
class Wave:
    nodes: list[str]
    outcome: str = PENDING
    started_wall_ns: int = 0
    done_wall_ns: int = 0  # every node upgraded; its soak starts
    ended_wall_ns: int = 0
    signal: str = ""  # why it failed, one line naming the node and the signal
    states: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # node -> (wall ns, upgrade state)
    disruptions: list[Disruption] = field(default_factory=list)
    probes: str = ""  # what its customer start probes showed, in one line


@dataclass
class Sweep:
    run_id: str
    key: VerdictKey
    target: tuple[str, str, str]  # api version, kind, name of what carries the version and the policy
    prior_version: str
    strategy: str
    soak_s: float
    waves: list[Wave]
    verdict_run: str  # the canary run whose verdict let it start
    status: str = RUNNING
    started_wall_ns: int = 0
    ended_wall_ns: int = 0
    rollback: str = ""  # what --rollback did, in words

    def current(self) -> int | None:
        """The first wave not passed; None when every wave passed."""
        return next((i for i, wave in enumerate(self.waves) if wave.outcome != PASSED), None)

    def nodes(self) -> list[str]:
        return [node for wave in self.waves for node in wave.nodes]

    def data(self) -> dict[str, str]:
        record = asdict(self)
        record["key"] = self.key.labels()
        return {"sweep": json.dumps(record, sort_keys=True), "run-id": self.run_id, "status": self.status}

    @classmethod
    def from_data(cls, data: dict[str, str]) -> Sweep:
        """Inverse of `data`; ValueError, KeyError or TypeError when it is not one."""
        record = json.loads(data["sweep"])
        key = record.pop("key")
        waves = [
            Wave(
                **{
                    **w,
                    "states": {n: [tuple(s) for s in seen] for n, seen in w["states"].items()},
                    "disruptions": [Disruption(**d) for d in w["disruptions"]],
                }
            )
            for w in record.pop("waves")
        ]
        return cls(
            **{
                **record,
                "key": VerdictKey(key["policy_digest"], key["target"], key["release"]),
                "target": tuple(record["target"]),
                "waves": waves,
            }
        )
