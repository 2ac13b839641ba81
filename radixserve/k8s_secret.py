"""Kubernetes: create the TLS Secret with a development CA when the cluster has none.

    python -m radixserve.k8s_secret --name radixserve-tls --hosts radixserve-router,...

Run by the `radixserve-certs` Job with a service account that may read and create Secrets in its
namespace. When the Secret exists (yours, from a real CA, or one made earlier) it is left alone;
otherwise `radixserve.dev_certs` makes a CA, certificates and tokens and they are stored as the
Secret, which every pod mounts (pods wait for it in ContainerCreating). The CA's key is not
stored: nothing in the cluster can issue more certificates; delete the Secret to start over.

It speaks to the API server with the pod's own credentials (the service-account token, CA and
namespace files), using only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from radixserve.dev_certs import FILES, write_dev_certs

ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Files of dev_certs that go into the Secret: everything but the CA's key.
SECRET_FILES = tuple(name for name in FILES if name != "ca-key.pem")
HTTP_TIMEOUT_S = 30.0
HTTP_NOT_FOUND = 404
HTTP_CONFLICT = 409


def in_cluster_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://{host}:{port}"


class ApiClient:
    """GET and POST of JSON against the API server, with a bearer token."""

    def __init__(self, url: str, token: str, ca_file: str | None) -> None:
        self._url = url.rstrip("/")
        self._token = token
        self._context = ssl.create_default_context(cafile=ca_file) if url.startswith("https") else None

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=self._context) as reply:
                return reply.status, json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


def secret_manifest(name: str, folder: Path) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "radixserve"}},
        "data": {f: base64.b64encode((folder / f).read_bytes()).decode() for f in SECRET_FILES},
    }


def ensure_secret(api: ApiClient, namespace: str, name: str, hosts: Sequence[str]) -> str:
    """"kept" when the Secret exists, "created" when this call made it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    status, reply = api.call("GET", f"{path}/{name}")
    if status == 200:
        return "kept"
    if status != HTTP_NOT_FOUND:
        raise RuntimeError(f"reading secret {name}: HTTP {status} {reply.get('message', '')}")
    with tempfile.TemporaryDirectory() as folder:
        write_dev_certs(Path(folder), hosts)
        status, reply = api.call("POST", path, secret_manifest(name, Path(folder)))
    if status == HTTP_CONFLICT:  # another run made it meanwhile: theirs stays
        return "kept"
    if status not in (200, 201):
        raise RuntimeError(f"creating secret {name}: HTTP {status} {reply.get('message', '')}")
    return "created"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixserve.k8s_secret",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="radixserve-tls", help="Secret name (default: %(default)s)")
    parser.add_argument("--hosts", default="", help="comma-separated service host names")
    parser.add_argument("--namespace", help="default: the pod's own namespace")
    parser.add_argument("--api-url", default=None, help="API server (default: in-cluster)")
    parser.add_argument("--account-dir", type=Path, default=ACCOUNT_DIR,
                        help="service-account token, ca.crt and namespace (default: %(default)s)")
    args = parser.parse_args(argv)
    token = (args.account_dir / "token").read_text().strip()
    namespace = args.namespace or (args.account_dir / "namespace").read_text().strip()
    ca_file = args.account_dir / "ca.crt"
    api = ApiClient(args.api_url or in_cluster_url(), token, str(ca_file) if ca_file.exists() else None)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    outcome = ensure_secret(api, namespace, args.name, hosts)
    print(f"k8s_secret: secret {namespace}/{args.name} {outcome}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
