"""What Helm rendered from gpu-operator Helm values: the ClusterPolicy picked out of `helm template`'s
manifests, and every upgradePolicy knob where the rendered CR says something the values file did not.

Pure: takes text and mappings, returns records. Running helm belongs to `policy.helm`; turning the
picked ClusterPolicy into an `UpgradePolicy` to `policy.parse`, which calls this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import yaml

from pytest_gpucanary.errors import ConfigError

CLUSTER_POLICY_KIND, CLUSTER_POLICY_API = "ClusterPolicy", "nvidia.com/v1"


@dataclass(frozen=True, slots=True)
class Rendered:
    chart: str  # the chart helm rendered, as given (a directory or a packaged .tgz)
    manifests: str  # helm template's stdout: every document the chart renders


class ValuesRenderer(Protocol):
    def render(self, values_text: str, *, source: str) -> Rendered: ...


@dataclass(frozen=True, slots=True)
class ChartNote:
    """A knob of the rendered upgradePolicy that the values file left out, or that the template changed."""

    knob: str  # CR-shaped key, e.g. "drain.enable"
    path: str  # where it sits (or would sit) in the values file
    rendered: Any
    given: Any = None
    in_values: bool = False

    def line(self) -> str:
        if not self.in_values:
            return f"{self.path}: not in values -> {json.dumps(self.rendered)} (chart default)"
        return f"{self.path}: {json.dumps(self.given)} in values -> {json.dumps(self.rendered)} (the chart's template)"


@dataclass(frozen=True, slots=True)
class Rendering:
    """How a Helm values policy became the CR the canary applies."""

    chart: str
    notes: tuple[ChartNote, ...] = ()

    def lines(self) -> tuple[str, ...]:
        return (f"rendered by helm template from chart {self.chart}", *(n.line() for n in self.notes))


def pick_cluster_policy(rendered: Rendered, *, source: str) -> Mapping[str, Any]:
    """The one ClusterPolicy (nvidia.com/v1) among the rendered manifests."""
    try:
        docs = [d for d in yaml.safe_load_all(rendered.manifests) if isinstance(d, Mapping)]
    except yaml.YAMLError as err:
        raise ConfigError(
            f"{source}: helm template of {rendered.chart} printed manifests that are not YAML ({err})",
            hint="check the chart's templates with helm lint",
        ) from None
    found = [d for d in docs if d.get("kind") == CLUSTER_POLICY_KIND and d.get("apiVersion") == CLUSTER_POLICY_API]
    if len(found) != 1:
        kinds = sorted({str(d.get("kind")) for d in docs})
        problem = "no ClusterPolicy" if not found else f"{len(found)} ClusterPolicies"
        raise ConfigError(
            f"{source}: helm template of {rendered.chart} rendered {problem} ({CLUSTER_POLICY_API}); "
            f"it rendered {', '.join(kinds) or 'nothing'}",
            hint="give the gpu-operator chart of the cluster's release",
        )
    return found[0]


def chart_notes(
    given: Mapping[str, Any], rendered: Mapping[str, Any], *, path_of: Callable[[str], str]
) -> tuple[ChartNote, ...]:
    """Every rendered knob (flat, CR-shaped keys) that `given` (the values file's knobs, same keys)
    leaves out or sets to something else; `path_of(knob)` names its place in the values file."""
    return tuple(
        ChartNote(knob, path_of(knob), value, given.get(knob), knob in given)
        for knob, value in rendered.items()
        if knob not in given or given[knob] != value
    )
