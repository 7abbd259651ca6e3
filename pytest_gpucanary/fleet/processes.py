"""Start, watch and stop fleet processes; each runs in its own session so it outlives the CLI.

A pid file alone can lie after a reboot or pid reuse, so a process counts as ours only while its
command line still names the fleet directory.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pytest_gpucanary.errors import EnvError
from pytest_gpucanary.fleet.components import Component
from pytest_gpucanary.fleet.layout import HOST, FleetLayout


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def owned_pids(layout: FleetLayout) -> list[int]:
    """Every live process whose command line names this fleet's directory (orphans included)."""
    marker = str(layout.root) + "/"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and marker in _cmdline(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def pid_of(layout: FleetLayout, name: str) -> int | None:
    try:
        pid = int((layout.run / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if str(layout.root) in _cmdline(pid) else None


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


def where(component: Component) -> str:
    """Where a component listens, for a progress line."""
    return f"on {HOST}:{component.port}" if component.port else "(it listens on no port)"


def start(layout: FleetLayout, component: Component) -> subprocess.Popen:
    if component.port and port_in_use(component.port):
        raise EnvError(
            f"port {HOST}:{component.port} for {component.name} is already in use",
            hint="stop what listens there or set GPUCANARY_FLEET_PORT_BASE to another base",
        )
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.run.mkdir(parents=True, exist_ok=True)
    with open(layout.logs / f"{component.name}.log", "wb") as log:
        proc = subprocess.Popen(
            component.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=layout.root,
            start_new_session=True,
            env={**os.environ, **dict(component.env)},
        )
    (layout.run / f"{component.name}.pid").write_text(str(proc.pid))
    return proc


def _ssl_context(layout: FleetLayout) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    context.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # components serve self-signed certs of their own too
    return context


def healthy(layout: FleetLayout, component: Component) -> bool:
    if not component.health_url:
        return pid_of(layout, component.name) is not None
    context = _ssl_context(layout) if component.health_url.startswith("https") else None
    try:
        with urllib.request.urlopen(component.health_url, timeout=2, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(layout: FleetLayout, component: Component, proc: subprocess.Popen, *, timeout_s: float) -> None:
    # proc.poll(), not pid_of(): /proc/<pid>/cmdline reads empty while the binary is still being exec'd
    deadline = time.monotonic() + (min(timeout_s, 3.0) if not component.health_url else timeout_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvError(
                f"{component.name} exited during start-up: {_last_log_line(layout, component.name)}",
                hint=f"see {layout.logs / (component.name + '.log')}",
            )
        if component.health_url and healthy(layout, component):
            return
        time.sleep(0.2)
    if not component.health_url:  # no health check: running 3 s after the start is healthy
        return
    raise EnvError(
        f"{component.name} was not healthy after {timeout_s:.0f} s at {component.health_url}",
        hint=f"see {layout.logs / (component.name + '.log')}",
    )


def _last_log_line(layout: FleetLayout, name: str) -> str:
    try:
        lines = (layout.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


STOP_ORDER = (
    "ingress",
    "node-agent",
    "nfd-master",
    "gpu-operator",
    "prometheus",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)


def stop_all(layout: FleetLayout) -> list[int]:
    """Stop every owned process, clients before the apiserver before etcd; returns the pids stopped.

    Stopped all at once, the apiserver spends ~10 s retrying a vanished etcd; in order it takes ~1 s.
    Processes without a pid file (orphans of a crashed start) go last.
    """
    named = [pid for name in STOP_ORDER if (pid := pid_of(layout, name))]
    everything = named + [pid for pid in owned_pids(layout) if pid not in named]
    for pid in everything:
        _stop(pid)
    for path in layout.run.glob("*.pid") if layout.run.exists() else ():
        path.unlink(missing_ok=True)
    return everything


def stop_one(layout: FleetLayout, name: str) -> int | None:
    """Stop one component (SIGTERM, then SIGKILL after 10 s) and forget its pid; returns the pid stopped."""
    pid = pid_of(layout, name)
    if pid is not None:
        _stop(pid)
    (layout.run / f"{name}.pid").unlink(missing_ok=True)
    return pid


def pause(layout: FleetLayout, name: str) -> int:
    """SIGSTOP one component's process group: it holds its sockets open and answers nothing, as a hung
    or swapped-out process would. `resume` sends SIGCONT."""
    pid = pid_of(layout, name)
    if pid is None:
        raise EnvError(f"{name} is not running in {layout.root}", hint="start the fleet first")
    _signal(pid, signal.SIGSTOP)
    return pid


def resume(layout: FleetLayout, name: str) -> None:
    if (pid := pid_of(layout, name)) is not None:
        _signal(pid, signal.SIGCONT)


def _stop(pid: int, *, grace_s: float = 10.0) -> None:
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5  # the kernel tears a killed process down asynchronously
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig) if os.getpgid(pid) == pid else os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][:1] != "Z"  # a zombie has exited; only its parent's wait is left
