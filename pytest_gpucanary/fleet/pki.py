"""A throw-away CA and one admin identity for the fleet, made with the openssl command.

One certificate serves as the apiserver's serving cert, every client's cert and the
service-account signing key, the way kwokctl sets up its clusters.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pytest_gpucanary.errors import EnvError

KUBERNETES_SERVICE_IP = "10.96.0.1"  # the kubernetes Service's ClusterIP: the first of --service-cluster-ip-range
# also the kubernetes Service's address, which pods that use in-cluster config dial (a kubelet node in GPUCluster mode)
_SAN = f"subjectAltName=DNS:localhost,IP:127.0.0.1,IP:{KUBERNETES_SERVICE_IP},DNS:kubernetes,DNS:kubernetes.default.svc"
_EXT = f"{_SAN}\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n"


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise EnvError(f"openssl {args[0]} failed: {result.stderr.strip().splitlines()[-1:]}")


def ensure_pki(pki: Path) -> None:
    """Create ca.crt/ca.key and admin.crt/admin.key once; later calls keep them."""
    if (pki / "admin.crt").exists() and (pki / "admin.key").exists():
        return
    if shutil.which("openssl") is None:
        raise EnvError("openssl is not installed", hint="apt-get install openssl")
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=gpucanary-fleet-ca",
        cwd=pki,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "admin.key",
        "-out",
        "admin.csr",
        "-subj",
        "/O=system:masters/CN=kwok-admin",
        cwd=pki,
    )
    (pki / "admin.ext").write_text(_EXT)
    _openssl(
        "x509",
        "-req",
        "-in",
        "admin.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-out",
        "admin.crt",
        "-extfile",
        "admin.ext",
        cwd=pki,
    )


def write_kubeconfig(path: Path, *, server: str, pki: Path) -> None:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters:\n- name: gpucanary-fleet\n  cluster:\n"
        f"    server: {server}\n    certificate-authority: {pki / 'ca.crt'}\n"
        "users:\n- name: gpucanary-admin\n  user:\n"
        f"    client-certificate: {pki / 'admin.crt'}\n    client-key: {pki / 'admin.key'}\n"
        "contexts:\n- name: gpucanary-fleet\n  context:\n    cluster: gpucanary-fleet\n    user: gpucanary-admin\n"
        "current-context: gpucanary-fleet\n"
    )
