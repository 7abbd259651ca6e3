"""Prometheus evidence for the ladder: the GPU Operator's upgrade counters and DCGM device metrics.

Queries go through prometheus-api-client with explicit connect and read timeouts, a server-side
query timeout and at most one retry, so an unreachable Prometheus costs seconds, not minutes.
Unreachable, timed out, an error answer, or no data makes a check INCONCLUSIVE with a one-line
detail, never PASS. Times passed in are wall clock (Unix ns); Prometheus samples have its scrape
interval's resolution (5 s on the local fleet). Nothing here judges: the answers go into the evidence
as they came, and the ladder judges them (ladder/metrics.py).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from pytest_gpucanary.errors import GpucanaryError
from pytest_gpucanary.ladder.metrics import DRIVER_LABEL, NODE_LABEL
from pytest_gpucanary.ladder.model import MetricAnswer, Series
from pytest_gpucanary.safe_text import redact_url

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 5.0
# timestamp() drops metric names, so one metric must carry the driver label; GPU_UTIL is in
# dcgm-exporter's default counter set
DRIVER_CARRIER = "DCGM_FI_DEV_GPU_UTIL"


class MetricsError(GpucanaryError):
    """Prometheus could not answer a query: unreachable, timed out, or an error status."""


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


# --- the shipped checks' queries: answers kept unjudged, the ladder judges them (ladder/metrics.py) ----


def ask(prom: Prometheus, name: str, promql: str, *, span: str, at_wall_ns: int | None) -> MetricAnswer:
    """One check's query and what Prometheus answered, or why it did not."""
    try:
        return MetricAnswer(name, promql, span, tuple(prom.query(promql, at_wall_ns=at_wall_ns)))
    except MetricsError as err:
        return MetricAnswer(name, promql, span, error=str(err))


def ask_upgrade_failed(prom: Prometheus, *, start_wall_ns: int, end_wall_ns: int) -> MetricAnswer:
    span = window(start_wall_ns, end_wall_ns)
    promql = f"max(max_over_time(gpu_operator_nodes_upgrades_failed[{span}]))"
    return ask(prom, "no-upgrade-failed", promql, span=span, at_wall_ns=end_wall_ns)


def ask_xid_errors(prom: Prometheus, *, nodes: Sequence[str], start_wall_ns: int, end_wall_ns: int) -> MetricAnswer:
    span = window(start_wall_ns, end_wall_ns)
    selector = f'DCGM_FI_DEV_XID_ERRORS{{{NODE_LABEL}=~"{node_regex(nodes)}"}}'
    promql = f"max by ({NODE_LABEL}, gpu) (max_over_time({selector}[{span}]))"
    return ask(prom, "no-xid-errors", promql, span=span, at_wall_ns=end_wall_ns)


def ask_driver_version(
    prom: Prometheus, *, nodes: Sequence[str], at_wall_ns: int | None = None, span: str = "now"
) -> MetricAnswer:
    """The driver version label of each node's newest DCGM series (the judge compares it with the target)."""
    selector = f'{DRIVER_CARRIER}{{{NODE_LABEL}=~"{node_regex(nodes)}"}}'
    promql = f"max by ({NODE_LABEL}, {DRIVER_LABEL}) (timestamp({selector}))"
    return ask(prom, "dcgm-driver-version", promql, span=span, at_wall_ns=at_wall_ns)


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


def default_answers(
    url: str,
    *,
    nodes: Sequence[str],
    start_wall_ns: int,
    end_wall_ns: int,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> tuple[MetricAnswer, ...]:
    """The shipped checks' answers over the run window [start, end]: operator failures, XIDs, and the driver
    version at the end."""
    with Prometheus(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s) as prom:
        return (
            ask_upgrade_failed(prom, start_wall_ns=start_wall_ns, end_wall_ns=end_wall_ns),
            ask_xid_errors(prom, nodes=nodes, start_wall_ns=start_wall_ns, end_wall_ns=end_wall_ns),
            ask_driver_version(prom, nodes=nodes, at_wall_ns=end_wall_ns, span=window(start_wall_ns, end_wall_ns)),
        )
