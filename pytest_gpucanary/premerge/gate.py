"""The pre-merge gate: canary base and head of an upgrade-policy change, one side-by-side verdict.

`gate()` reads both policies (files or `git:REF:PATH`), diffs them statically (policy/lint.py), runs
`gpucanary run` once per policy as a subprocess with the same run options (target driver, workloads,
load, probes), reads each run's evidence and receipt back, compares them (`ladder.compare`) and writes
reports/gate-<id>/ (receipt/gate.py). Each run makes and restores its own pool and objects under its
own run id; this module never talks to the cluster itself. The runs go in parallel only when the
caller says the cluster keeps their policies apart (operator v26.7+, one upgradePolicy per
NVIDIADriver, a pool made per run); else one after the other, as one cluster-wide policy would let
the second run change the first one's upgrade.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pytest_gpucanary.checks import RUN_ID_MAX, run_id_rule
from pytest_gpucanary.config import flag
from pytest_gpucanary.errors import ConfigError, EnvError
from pytest_gpucanary.ladder import RunEvidence
from pytest_gpucanary.policy import diff as policy_diff
from pytest_gpucanary.policy import lint as policy_lint
from pytest_gpucanary.policy.parse import load_policy
from pytest_gpucanary.policy.render import ValuesRenderer
from pytest_gpucanary.premerge.compare import Comparison, Side, compare
from pytest_gpucanary.premerge.receipt import write_gate_receipt
from pytest_gpucanary.receipt import FILES as RUN_FILES
from pytest_gpucanary.receipt.json import parse_json

GIT_PREFIX = "git:"
# the gate gives each run its policy; it reads --gpucanary-run-id as its own id (the runs are <id>-base
# and <id>-head) and --gpucanary-reports-dir as the root of gate-<id>/, and gives each run both again, last
OWN_OPTIONS = ("policy",)
SIDES = ("base", "head")


@dataclass(frozen=True)
class RunSpec:
    label: str
    policy: Path  # a file on disk (a git:REF:PATH source is written out first)
    source: str  # as the caller named it
    run_id: str


@dataclass(frozen=True)
class GateOutcome:
    comparison: Comparison | None  # None when a run could not happen
    exit_codes: Mapping[str, int]  # per side, `gpucanary run`'s
    wall_s: float  # both runs, monotonic clock
    parallel: bool
    gate_dir: Path
    receipt: Mapping[str, str]


def read_source(source: str, *, into: Path, label: str, repo: Path | None = None) -> Path:
    """A policy path: the file itself, or `git show REF:PATH` of the current repository written into `into`."""
    if not source.startswith(GIT_PREFIX):
        return Path(source)
    ref, sep, path = source[len(GIT_PREFIX) :].partition(":")
    if not (ref and sep and path) or ref.startswith("-"):
        raise ConfigError(
            f"{source!r} is not git:REF:PATH", hint="e.g. git:origin/main:gpu-operator/upgrade-policy.yaml"
        )
    try:  # --end-of-options: whatever the user wrote is a revision, never an option of git's
        shown = subprocess.run(
            ["git", "show", "--end-of-options", f"{ref}:{path}"],
            capture_output=True,
            text=True,
            cwd=repo,
            timeout=60,
            check=False,
        )
    except FileNotFoundError as err:
        raise EnvError("git is not installed", hint="install git or give the policy as a file") from err
    if shown.returncode != 0:
        why = (shown.stderr.strip().splitlines() or ["git show failed"])[0][:200]
        raise ConfigError(
            f"cannot read {source!r}: {why}",
            hint="fetch the ref first (git fetch origin) and check the path at that ref",
        )
    into.mkdir(parents=True, exist_ok=True)
    written = into / f"{label}-{Path(path).name}"
    written.write_text(shown.stdout, encoding="utf-8")
    return written


def check_run_args(run_args: Sequence[str]) -> None:
    for name in OWN_OPTIONS:
        if any(a == flag(name) or a.startswith(flag(name) + "=") for a in run_args):
            raise ConfigError(
                f"gate sets {flag(name)} for each run itself",
                hint="give the policies as --base and --head; the gate names each run",
            )


def _command(spec: RunSpec, run_args: Sequence[str], runs_dir: Path) -> list[str]:
    # -P: the installed package, never a pytest_gpucanary/ folder in the current directory (a checkout's)
    return [
        sys.executable,
        "-P",
        "-m",
        "pytest_gpucanary.cli",
        "run",
        *run_args,
        f"{flag('policy')}={spec.policy}",
        f"{flag('run_id')}={spec.run_id}",
        f"{flag('reports_dir')}={runs_dir}",
        "-p",
        "no:cacheprovider",
    ]


def run_all(
    specs: Sequence[RunSpec],
    *,
    run_args: Sequence[str],
    gate_dir: Path,
    parallel: bool,
    env: Mapping[str, str],
    progress: Callable[[str], None],
) -> tuple[dict[str, int], float]:
    """Every spec's `gpucanary run`, its output in gate_dir/<label>.log; the exit codes and the wall time."""
    started = time.monotonic()
    codes: dict[str, int] = {}
    running: list[tuple[RunSpec, subprocess.Popen, TextIO]] = []
    try:
        for spec in specs:
            log: TextIO = open(gate_dir / f"{spec.label}.log", "w", encoding="utf-8")
            progress(f"gate: {spec.label} run {spec.run_id} of {spec.source} started (log {log.name})")
            # same process group: a Ctrl-C reaches both runs, and each unwinds its own undo stack
            proc = subprocess.Popen(
                _command(spec, run_args, gate_dir), stdout=log, stderr=subprocess.STDOUT, env=dict(env)
            )
            running.append((spec, proc, log))
            if not parallel:
                codes[spec.label] = _finish(spec, proc, started, progress)
        for spec, proc, _ in running:
            if spec.label not in codes:
                codes[spec.label] = _finish(spec, proc, started, progress)
    finally:
        for _, proc, log in running:  # SIGTERM ends a run the same way: it restores, then exits 2
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            log.close()
    return codes, time.monotonic() - started


def _finish(spec: RunSpec, proc: subprocess.Popen, started: float, progress: Callable[[str], None]) -> int:
    code = proc.wait()
    progress(f"gate: {spec.label} run {spec.run_id} ended with exit {code} at +{time.monotonic() - started:.1f} s")
    return code


def read_side(label: str, run_dir: Path) -> Side:
    try:
        evidence = RunEvidence.read(run_dir)
        result = parse_json((run_dir / RUN_FILES["json"]).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EnvError(
            f"the {label} run left no readable receipt in {run_dir} ({type(err).__name__})",
            hint=f"see {run_dir.parent / (label + '.log')}",
        ) from None
    return Side(label, evidence, result)


@dataclass(frozen=True)
class GatePlan:
    """What the gate knows before it touches a cluster: the two runs and the static diff."""

    gate_id: str
    gate_dir: Path
    specs: tuple[RunSpec, ...]
    changes: tuple[policy_diff.Change, ...]
    findings: tuple[policy_lint.Finding, ...]  # of head


def plan(
    *,
    base: str,
    head: str,
    run_args: Sequence[str],
    reports_dir: Path,
    gate_id: str,
    helm: ValuesRenderer | None = None,
) -> GatePlan:
    """Read and lint both policies (Helm values rendered by `helm`); every input fault is raised here,
    before any cluster is contacted."""
    check_run_args(run_args)
    longest = max(len(f"{gate_id}-{label}") for label in SIDES)
    if run_id_rule(f"{gate_id}-base"):
        raise ConfigError(
            f"{flag('run_id')}={gate_id!r} gives run ids such as {gate_id}-base, {longest} characters, "
            f"which {run_id_rule(f'{gate_id}-base')}",
            hint=f"give at most {RUN_ID_MAX - 5} characters",
        )
    gate_dir = reports_dir / f"gate-{gate_id}"
    try:
        gate_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create {str(gate_dir)!r}: {err.strerror}",
            hint=f"point {flag('reports_dir')} at a writable directory",
        ) from err
    paths = {
        label: read_source(source, into=gate_dir / "policies", label=label)
        for label, source in zip(SIDES, (base, head))
    }
    policies = {label: load_policy(path, helm=helm) for label, path in paths.items()}
    specs = tuple(
        RunSpec(label, paths[label], source, f"{gate_id}-{label}") for label, source in zip(SIDES, (base, head))
    )
    return GatePlan(
        gate_id,
        gate_dir,
        specs,
        tuple(policy_diff.diff_policies(policies["base"], policies["head"])),
        tuple(policy_lint.lint_policy(policies["head"])),
    )


def gate(
    planned: GatePlan,
    *,
    run_args: Sequence[str],
    parallel: bool,
    env: Mapping[str, str] = os.environ,
    progress: Callable[[str], None],
) -> GateOutcome:
    gate_dir, specs, changes, findings = planned.gate_dir, planned.specs, planned.changes, planned.findings
    for line in policy_diff.render_lines(list(findings), list(changes)).splitlines():
        progress(f"gate: lint: {line}")
    progress(f"gate: running base and head {'in parallel' if parallel else 'one after the other'}")
    codes, wall_s = run_all(specs, run_args=run_args, gate_dir=gate_dir, parallel=parallel, env=env, progress=progress)
    progress(f"gate: both runs took {wall_s:.1f} s (wall, monotonic)")
    if any(code not in (0, 1) for code in codes.values()):
        return GateOutcome(None, codes, wall_s, parallel, gate_dir, {})
    sides = [read_side(spec.label, gate_dir / spec.run_id) for spec in specs]
    comparison = compare(*sides)
    written = write_gate_receipt(gate_dir, comparison, changes, findings)
    return GateOutcome(comparison, codes, wall_s, parallel, gate_dir, {k: str(p) for k, p in written.items()})
