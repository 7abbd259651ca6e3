"""Prometheus evidence for the ladder: the GPU Operator's upgrade counters and DCGM device metrics.

Queries go through prometheus-api-client with explicit connect and read timeouts, a server-side
query timeout and at most one retry, so an unreachable Prometheus costs seconds, not minutes.
Unreachable, timed out, an error answer, or no data makes a check INCONCLUSIVE with a one-line
detail, never PASS. Times passed in are wall clock (Unix ns); Prometheus samples have its scrape
interval's resolution (5 s on the local fleet). The judging functions are pure and take `Series`.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.ladder import MetricCheck, Outcome, Stage
from pytest_gpucanary.safe_text import redact_url

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0
NODE_LABEL = "Hostname"  # dcgm-exporter's node label; relabelled setups may use another
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
# timestamp() drops metric names, so one metric must carry the driver label; GPU_UTIL is in
# dcgm-exporter's default counter set
DRIVER_CARRIER = "DCGM_FI_DEV_GPU_UTIL"


class MetricsError(GpucanaryError):
    """Prometheus could not answer a query: unreachable, timed out, or an error status."""


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str] = field(hash=False)
    t_s: float  # sample time, Prometheus clock (Unix s)
    value: float


def _error_line(exc: PrometheusApiClientException) -> str:
    """The status and Prometheus' own `error` field, never the raw body.

    The client formats its exception as `HTTP Status Code <n> (<repr of the body bytes>)`."""
    found = re.match(r"HTTP Status Code (\d+) \((b['\"].*['\"])\)$", str(exc), re.S)
    if not found:
        return str(exc)[:80]
    try:
        reason = str(json.loads(ast.literal_eval(found.group(2))).get("error", ""))
    except (ValueError, SyntaxError, AttributeError):
        reason = ""
    return f"HTTP {found.group(1)}" + (f": {reason[:160]}" if reason else "")


class Prometheus:
    """One Prometheus endpoint; `query` raises MetricsError with a one-line message."""

    def __init__(
        self, url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S
    ) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url)  # what messages say: never a password or token in the URL
        self.timeout = (connect_timeout_s, read_timeout_s)
        # read=False: a read timeout surfaces as itself (not wrapped as a connection error) and is not retried
        retry = Retry(total=1, read=False, backoff_factor=0.5, status_forcelist=(502, 503, 504))
        self._client = PrometheusConnect(url=self.url, retry=retry, timeout=self.timeout)

    def query(self, promql: str, *, at_wall_ns: int | None = None) -> list[Series]:
        """An instant query (at `at_wall_ns`, else now); vector results only, NaN samples dropped."""
        params = {"timeout": f"{self.timeout[1]:g}s"}
        if at_wall_ns is not None:
            params["time"] = f"{at_wall_ns / 1e9:.3f}"
        try:
            result = self._client.custom_query(promql, params=params, timeout=self.timeout)
        except (requests.exceptions.JSONDecodeError, KeyError, TypeError) as exc:  # something else on that port
            raise MetricsError(f"{self.shown} did not answer like Prometheus (no JSON data.result)") from exc
        except requests.Timeout as exc:
            raise MetricsError(
                f"Prometheus at {self.shown} timed out ({self.timeout[0]:g} s to connect, "
                f"{self.timeout[1]:g} s to answer)"
            ) from exc
        except requests.exceptions.RetryError as exc:
            raise MetricsError(f"Prometheus at {self.shown} answered 5xx twice") from exc
        except requests.RequestException as exc:
            raise MetricsError(f"Prometheus at {self.shown} is unreachable ({type(exc).__name__})") from exc
        except PrometheusApiClientException as exc:
            raise MetricsError(f"Prometheus at {self.shown} refused the query: {_error_line(exc)}") from exc
        return _vector(result)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _vector(result: object) -> list[Series]:
    if not isinstance(result, list):  # a scalar or string result: [ts, "v"]
        raise MetricsError("query did not return an instant vector; wrap it so it returns series")
    series = []
    for item in result:
        try:
            t_s, value = item["value"]
        except (KeyError, TypeError, ValueError):
            raise MetricsError("query did not return an instant vector (a range selector needs *_over_time)") from None
        if not math.isnan(float(value)):
            series.append(Series(item.get("metric", {}), float(t_s), float(value)))
    return series


def query(
    promql: str,
    *,
    url: str,
    at_wall_ns: int | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> list[Series]:
    """One instant query for canaries; raises MetricsError (one line) when Prometheus cannot answer."""
    with Prometheus(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s) as prom:
        return prom.query(promql, at_wall_ns=at_wall_ns)


def window(start_wall_ns: int, end_wall_ns: int) -> str:
    """A PromQL range covering the run, whole seconds, at least 1 s."""
    return f"{max(1, math.ceil((end_wall_ns - start_wall_ns) / 1e9))}s"


def node_regex(nodes: Sequence[str]) -> str:
    """A PromQL regex string body matching exactly these node names (dots escaped for RE2 and PromQL)."""
    return "|".join(re.sub(r"([.+*?()\[\]{}|^$\\])", r"\\\\\1", n) for n in sorted(nodes))


# --- pure judges -------------------------------------------------------------------------------------


def judge_upgrade_failed(series: Sequence[Series], *, span: str) -> MetricCheck:
    name, what = "no-upgrade-failed", "max(gpu_operator_nodes_upgrades_failed)"
    if not series:
        return MetricCheck(
            name,
            Stage.ROLLOUT,
            Outcome.INCONCLUSIVE,
            None,
            f"no {what} samples over the last {span} (is the GPU Operator scraped?)",
        )
    worst = max(s.value for s in series)
    outcome = Outcome.PASS if worst == 0 else Outcome.FAIL
    return MetricCheck(name, Stage.ROLLOUT, outcome, worst, f"{what} over the run ({span}) = {worst:g}, expected 0")


def judge_xid(
    series: Sequence[Series], *, nodes: Sequence[str], span: str, node_label: str = NODE_LABEL
) -> MetricCheck:
    name = "no-xid-errors"
    if not nodes:
        return MetricCheck(name, Stage.DEVICE, Outcome.INCONCLUSIVE, None, "no pool nodes given")
    missing = sorted(set(nodes) - {s.labels.get(node_label, "") for s in series})
    bad = sorted((s for s in series if s.value != 0), key=lambda s: -s.value)
    if bad:
        s = bad[0]
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.FAIL,
            s.value,
            f"{s.labels.get(node_label, '?')} GPU {s.labels.get('gpu', '?')} reported XID {s.value:g} "
            f"within {span} ({len(bad)} GPU(s) with XIDs), expected none",
        )
    if missing:
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.INCONCLUSIVE,
            None,
            f"no DCGM_FI_DEV_XID_ERRORS samples within {span} for {', '.join(missing)}",
        )
    return MetricCheck(
        name,
        Stage.DEVICE,
        Outcome.PASS,
        0.0,
        f"max DCGM_FI_DEV_XID_ERRORS over {span} = 0 on {len(nodes)} node(s), {len(series)} GPU(s)",
    )


def latest_versions(series: Sequence[Series], *, node_label: str = NODE_LABEL) -> dict[str, str]:
    """Per node, the driver version label of its newest sample (value = sample time)."""
    newest: dict[str, Series] = {}
    for s in series:
        node = s.labels.get(node_label, "")
        if node not in newest or s.value > newest[node].value:
            newest[node] = s
    return {node: s.labels.get(DRIVER_LABEL, "") for node, s in newest.items()}


def judge_driver_version(
    series: Sequence[Series], *, nodes: Sequence[str], target: str, node_label: str = NODE_LABEL
) -> MetricCheck:
    name = "dcgm-driver-version"
    if not nodes:
        return MetricCheck(name, Stage.DEVICE, Outcome.INCONCLUSIVE, None, "no pool nodes given")
    versions = latest_versions(series, node_label=node_label)
    wrong = sorted(f"{n} reports {versions[n]}" for n in nodes if versions.get(n) and versions[n] != target)
    at_target = sum(versions.get(n) == target for n in nodes)
    if wrong:
        return MetricCheck(
            name, Stage.DEVICE, Outcome.FAIL, float(at_target), f"{'; '.join(wrong)}; expected {DRIVER_LABEL}={target}"
        )
    unknown = sorted(n for n in nodes if not versions.get(n))
    if unknown:
        return MetricCheck(
            name,
            Stage.DEVICE,
            Outcome.INCONCLUSIVE,
            None,
            f"no DCGM series with a {DRIVER_LABEL} label for {', '.join(unknown)}",
        )
    return MetricCheck(
        name,
        Stage.DEVICE,
        Outcome.PASS,
        float(at_target),
        f"{at_target}/{len(nodes)} node(s) report {DRIVER_LABEL}={target}",
    )


# --- checks: query, then judge; a query that cannot be answered is inconclusive ----------------------


def _unanswered(name: str, stage: Stage, err: MetricsError) -> MetricCheck:
    return MetricCheck(name, stage, Outcome.INCONCLUSIVE, None, str(err))


def check_no_upgrade_failed(prom: Prometheus, *, start_wall_ns: int, end_wall_ns: int) -> MetricCheck:
    span = window(start_wall_ns, end_wall_ns)
    try:
        series = prom.query(f"max(max_over_time(gpu_operator_nodes_upgrades_failed[{span}]))", at_wall_ns=end_wall_ns)
    except MetricsError as err:
        return _unanswered("no-upgrade-failed", Stage.ROLLOUT, err)
    return judge_upgrade_failed(series, span=span)


def check_no_xid_errors(
    prom: Prometheus, *, nodes: Sequence[str], start_wall_ns: int, end_wall_ns: int, node_label: str = NODE_LABEL
) -> MetricCheck:
    span = window(start_wall_ns, end_wall_ns)
    promql = (
        f'max by ({node_label}, gpu) (max_over_time(DCGM_FI_DEV_XID_ERRORS{{{node_label}=~"{node_regex(nodes)}"}}'
        f"[{span}]))"
    )
    try:
        series = prom.query(promql, at_wall_ns=end_wall_ns)
    except MetricsError as err:
        return _unanswered("no-xid-errors", Stage.DEVICE, err)
    return judge_xid(series, nodes=nodes, span=span, node_label=node_label)


def check_dcgm_driver_version(
    prom: Prometheus, *, nodes: Sequence[str], target: str, at_wall_ns: int | None = None, node_label: str = NODE_LABEL
) -> MetricCheck:
    """The driver version label on each node's newest DCGM series equals `target` (exact match)."""
    selector = f'{DRIVER_CARRIER}{{{node_label}=~"{node_regex(nodes)}"}}'
    try:
        series = prom.query(f"max by ({node_label}, {DRIVER_LABEL}) (timestamp({selector}))", at_wall_ns=at_wall_ns)
    except MetricsError as err:
        return _unanswered("dcgm-driver-version", Stage.DEVICE, err)
    return judge_driver_version(series, nodes=nodes, target=target, node_label=node_label)


# what the shipped checks read, each as a query that returns a series only when the data is there
NEEDED_SERIES = (
    (
        "count(gpu_operator_nodes_upgrades_failed)",
        "gpu_operator_nodes_upgrades_failed",
        "the rollout check",
        "scrape the GPU Operator's metrics endpoint",
    ),
    ("count(DCGM_FI_DEV_XID_ERRORS)", "DCGM_FI_DEV_XID_ERRORS", "the XID check", "scrape dcgm-exporter"),
    (
        f'count({DRIVER_CARRIER}{{{DRIVER_LABEL}!=""}})',
        f"{DRIVER_CARRIER} with a {DRIVER_LABEL} label",
        "the driver-version check",
        "scrape dcgm-exporter with its default counters",
    ),
)


def missing_series(
    url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, read_timeout_s: float = READ_TIMEOUT_S
) -> list[str]:
    """One line per series the shipped checks need that Prometheus at `url` does not have (or one line
    saying it does not answer); empty when every check can be judged."""
    lines = []
    with Prometheus(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s) as prom:
        for promql, series, needed_by, fix in NEEDED_SERIES:
            try:
                found = prom.query(promql)
            except MetricsError as err:
                return [f"Prometheus does not answer: {err}"]
            if not found or not any(s.value > 0 for s in found):
                lines.append(f"Prometheus at {prom.shown} has no {series} series ({needed_by} needs it); {fix}")
    return lines


def default_checks(
    url: str,
    *,
    nodes: Sequence[str],
    target_driver: str,
    start_wall_ns: int,
    end_wall_ns: int,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
    node_label: str = NODE_LABEL,
) -> tuple[MetricCheck, ...]:
    """The shipped checks over the run window [start, end]: operator failures, XIDs, driver version at the end."""
    with Prometheus(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s) as prom:
        return (
            check_no_upgrade_failed(prom, start_wall_ns=start_wall_ns, end_wall_ns=end_wall_ns),
            check_no_xid_errors(
                prom, nodes=nodes, start_wall_ns=start_wall_ns, end_wall_ns=end_wall_ns, node_label=node_label
            ),
            check_dcgm_driver_version(
                prom, nodes=nodes, target=target_driver, at_wall_ns=end_wall_ns, node_label=node_label
            ),
        )
