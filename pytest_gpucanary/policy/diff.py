"""What changed between two valid upgrade policies, knob by knob, with the findings each change adds or
removes; and the lint's report of findings and changes, as lines or JSON. Pure, like the lint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pytest_gpucanary.policy.lint import RULES, Finding, lint_policy
from pytest_gpucanary.policy.model import UpgradePolicy


@dataclass(frozen=True, slots=True)
class Change:
    knob: str  # CR-shaped key, e.g. "drain.enable"
    path: str  # where it sits in the new document
    old: bool | int | str
    new: bool | int | str
    introduced: tuple[Finding, ...]  # findings the new policy has and the old one had not
    removed: tuple[Finding, ...]


def diff_policies(old: UpgradePolicy, new: UpgradePolicy) -> list[Change]:
    """The knobs that differ, in CR order, each with the findings its change adds or removes."""
    before, after = old.knobs(), new.knobs()
    changed = [knob for knob in after if before[knob] != after[knob]]
    old_findings = {(f.code, f.severity): f for f in lint_policy(old)}
    new_findings = {(f.code, f.severity): f for f in lint_policy(new)}
    introduced = [f for key, f in new_findings.items() if key not in old_findings]
    removed = [f for key, f in old_findings.items() if key not in new_findings]
    owners = {rule.code: next((k for k in rule.knobs if k in changed), None) for rule in RULES}
    return [
        Change(
            knob=knob,
            path=new.path_of(knob),
            old=before[knob],
            new=after[knob],
            introduced=tuple(f for f in introduced if owners[f.code] == knob),
            removed=tuple(f for f in removed if owners[f.code] == knob),
        )
        for knob in changed
    ]


def render_lines(
    findings: list[Finding], changes: list[Change] | None = None, *, policy: UpgradePolicy | None = None
) -> str:
    """For Helm values (`policy.rendering`), first `rendered by ...: {CR}` and one `chart PATH: ...` per
    knob the chart filled in or changed; then `change PATH: OLD -> NEW` with `  + finding` /
    `  - finding` under it; then one finding per line."""
    lines: list[str] = []
    if policy is not None and policy.rendering is not None:
        lines.append(f"{policy.rendering.lines()[0]}: spec.driver.upgradePolicy {json.dumps(policy.to_cr())}")
        lines += [f"chart {note.line()}" for note in policy.rendering.notes]
    for change in changes or ():
        lines.append(f"change {change.path}: {json.dumps(change.old)} -> {json.dumps(change.new)}")
        lines += [f"  + {f.line()}" for f in change.introduced] + [f"  - {f.line()}" for f in change.removed]
    return "\n".join(lines + [f.line() for f in findings])


def render_json(
    findings: list[Finding], changes: list[Change] | None = None, *, policy: UpgradePolicy | None = None
) -> str:
    document: dict[str, Any] = {"findings": [_finding_dict(f) for f in findings]}
    if policy is not None and policy.rendering is not None:
        document["rendered"] = {
            "chart": policy.rendering.chart,
            "upgradePolicy": policy.to_cr(),
            "notes": [
                {
                    "knob": n.knob,
                    "path": n.path,
                    "in_values": n.in_values,
                    "values": n.given,
                    "rendered": n.rendered,
                    "line": n.line(),
                }
                for n in policy.rendering.notes
            ],
        }
    if changes is not None:
        document["changes"] = [
            {
                "knob": c.knob,
                "path": c.path,
                "old": c.old,
                "new": c.new,
                "introduced": [_finding_dict(f) for f in c.introduced],
                "removed": [_finding_dict(f) for f in c.removed],
            }
            for c in changes
        ]
    return json.dumps(document, indent=2)


def _finding_dict(finding: Finding) -> dict[str, str]:
    return {"severity": finding.severity.value, "code": finding.code, "path": finding.path, "message": finding.message}
