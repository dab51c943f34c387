"""The few calls of the Kubernetes API the node-pool provider makes: pods in one namespace, and a TokenReview.

Plain HTTPS with httpx (no client library): in the cluster, the pod's service-account token and CA
(`/var/run/secrets/kubernetes.io/serviceaccount`) at `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`;
`INFERPLANE_K8S_API_URL` points elsewhere (a test's server). The token is read on every client
build, since the kubelet rotates it.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from endpoints.fleet.providers.base import ProviderError, ProviderUnreachable

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0


def service_account_namespace(account_dir: Path | None = None) -> str:
    """The namespace of this pod's service account ("default" outside a cluster)."""
    namespace_file = (account_dir or SERVICE_ACCOUNT_DIR) / "namespace"
    return namespace_file.read_text().strip() if namespace_file.exists() else "default"


class KubernetesApi:
    def __init__(self, base_url: str, token: str, *, verify: str | bool = True):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._verify = verify

    @classmethod
    def in_cluster(cls, api_url: str = "", account_dir: Path | None = None) -> KubernetesApi:
        account_dir = account_dir or SERVICE_ACCOUNT_DIR
        token_file, ca_file = account_dir / "token", account_dir / "ca.crt"
        token = token_file.read_text().strip() if token_file.exists() else ""
        if not api_url:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host or not token:
                raise ProviderError("not inside a Kubernetes cluster (no service account): set INFERPLANE_K8S_API_URL")
            api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        return cls(api_url, token, verify=str(ca_file) if ca_file.exists() else True)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            with httpx.Client(base_url=self.base_url, headers=self._headers, verify=self._verify,
                              timeout=TIMEOUT_S) as client:
                return client.request(method, path, **kwargs)
        except httpx.HTTPError as error:  # NOTE: a read timeout too: the API server may have done it
            raise ProviderUnreachable(f"the Kubernetes API is unreachable: {error}") from error

    @staticmethod
    def _refusal(response: httpx.Response, doing: str) -> ProviderError:
        try:
            message = response.json().get("message", "")
        except ValueError:
            message = response.text[:300]
        return ProviderError(f"Kubernetes refused to {doing} ({response.status_code}): {message}")

    def create_pod(self, namespace: str, pod: dict) -> tuple[dict, bool]:
        """(the pod, True) once created; (the existing pod, False) when one of that name exists."""
        response = self._call("POST", f"/api/v1/namespaces/{namespace}/pods", json=pod)
        if response.status_code == 409:
            existing = self.get_pod(namespace, pod["metadata"]["name"])
            if existing is not None:
                return existing, False
        if response.status_code >= 500:  # NOTE: the API server failing, a 504 too: the pod may have been created
            raise ProviderUnreachable(str(self._refusal(response, f"create pod {pod['metadata']['name']}")))
        if response.status_code not in (200, 201, 202):
            raise self._refusal(response, f"create pod {pod['metadata']['name']}")
        return response.json(), True

    def get_pod(self, namespace: str, name: str) -> dict | None:
        response = self._call("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._refusal(response, f"read pod {name}")
        return response.json()

    def delete_pod(self, namespace: str, name: str) -> None:
        response = self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                              params={"gracePeriodSeconds": "0"})
        if response.status_code not in (200, 202, 404):
            raise self._refusal(response, f"delete pod {name}")

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        pods, token = [], ""
        while True:
            params = {"labelSelector": label_selector, "limit": "500", **({"continue": token} if token else {})}
            response = self._call("GET", f"/api/v1/namespaces/{namespace}/pods", params=params)
            if response.status_code != 200:
                raise self._refusal(response, "list pods")
            body = response.json()
            pods += body.get("items", [])
            token = body.get("metadata", {}).get("continue", "")
            if not token:
                return pods

    def review_token(self, token: str, audience: str) -> dict:
        """The API server's review of `token` for `audience` (a TokenReview's `status`: `authenticated`, `user`,
        `audiences`, `error`). Needs `tokenreviews` `create` (a ClusterRole: infra/k8s/components/node-pools)."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                  "spec": {"token": token, "audiences": [audience]}}
        response = self._call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", json=review)
        # NOTE: a 429 too (API Priority and Fairness throttling the web pods' reviews): no answer about the token.
        # Before, it was a refusal of the agent's token.
        if response.status_code >= 500 or response.status_code == 429:
            raise ProviderUnreachable(str(self._refusal(response, "review a token")))
        if response.status_code not in (200, 201):
            raise self._refusal(response, "review a token")
        try:
            body = response.json()
        except ValueError:
            body = None
        # NOTE: a body that is no object (a proxy's answer) is no review either. Before, a JSON list was a 500.
        status = body.get("status") if isinstance(body, dict) else None
        if not isinstance(status, dict):
            raise ProviderError("the Kubernetes API answered a token review without a status")
        return status
