"""The inference API as clients reach it: the load balancer's HTTPS URL, the bearer token and the CA to trust, found
where the roles keep them on the controller, and a small client for it."""

from __future__ import annotations

import functools
import json
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster
from shardstack.ops.roles import role_default


def load_token(cluster: Cluster) -> str | None:
    """The bearer token the inference nodes expect, found as the inference_service role finds it: the inventory's
    `inference_service_token`, else the file at `inference_service_token_store` (the inventory's value, else the
    role's default), where the role keeps the token it generated. None when there is none yet."""
    hostvars = cluster.first_hostvars("inference_nodes")
    if hostvars.get("inference_service_token"):
        return str(hostvars["inference_service_token"])
    name = "inference_service_token_store"
    path = cluster.controller_path(name, str(hostvars.get(name) or role_default("inference_service", name)))
    return path.read_text().strip() if path.is_file() else None


# The cluster CA's certificate in loadbalancer_tls_store (the loadbalancer role's vars/main.yml names it too).
CLUSTER_CA = "cluster-ca.crt.txt"


def load_cluster_ca(cluster: Cluster) -> Path:
    """The cluster CA's certificate on the controller (in `loadbalancer_tls_store`): what the inference backends'
    certificates, and the load balancer's unless the inventory brings its own, are verified with."""
    hostvars = cluster.first_hostvars("loadbalancer")
    name = "loadbalancer_tls_store"
    store = cluster.controller_path(name, str(hostvars.get(name) or role_default("loadbalancer", name)))
    return store / CLUSTER_CA


def load_ca(cluster: Cluster) -> Path | None:
    """The CA certificate clients verify the load balancer with, found as the loadbalancer role finds it: the
    inventory's `loadbalancer_tls_ca`, else the cluster CA in `loadbalancer_tls_store` when the role issues the
    certificate; None (the system's trust store) for a certificate of the inventory's own without a CA named."""
    hostvars = cluster.first_hostvars("loadbalancer")
    if hostvars.get("loadbalancer_tls_ca"):
        return cluster.controller_path("loadbalancer_tls_ca", str(hostvars["loadbalancer_tls_ca"]))
    if hostvars.get("loadbalancer_tls_cert"):
        return None  # the inventory's own certificate and no CA named for it: a publicly trusted one
    return load_cluster_ca(cluster)


@dataclass(frozen=True)
class Endpoint:
    """The inference API as clients reach it: through the load balancer, over HTTPS, with the bearer token."""

    url: str
    token: str | None
    cafile: Path | None  # the CA to trust; None = the system's trust store

    @functools.cached_property
    def tls(self) -> ssl.SSLContext:
        if self.cafile is not None and not self.cafile.is_file():
            raise ShardstackError(f"no CA certificate at {self.cafile}",
                                  hint="the loadbalancer role creates the cluster CA there: deploy it first")
        return ssl.create_default_context(cafile=str(self.cafile) if self.cafile else None)

    def call(self, method: str, path: str, payload: dict[str, Any] | None = None, *,
             timeout: float = 30.0) -> tuple[int, bytes]:
        """One request → (status, body); an HTTP error status is an answer too. A refused or broken connection
        raises OSError; a certificate the client does not accept raises ShardstackError (one line and a hint)."""
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                raise self._tls_error(exc.reason) from None
            raise
        except ssl.SSLError as exc:
            raise self._tls_error(exc) from None

    def _tls_error(self, err: ssl.SSLError) -> ShardstackError:
        trust = f"the CA in {self.cafile}" if self.cafile else "the system's trust store"
        if isinstance(err, ssl.SSLCertVerificationError):
            why = err.verify_message or err.reason or str(err)
            hint = ("add the name you connect to to loadbalancer_tls_names and deploy again" if "mismatch" in why
                    else "set loadbalancer_tls_ca to the CA that signed the load balancer's certificate, or deploy "
                         "again so the load balancer serves the cluster CA's")
            return ShardstackError(f"TLS: {self.url} presented a certificate {trust} does not accept: {why}",
                                   hint=hint)
        return ShardstackError(f"TLS: handshake with {self.url} failed: {err.reason or err}")


def endpoint(cluster: Cluster) -> Endpoint:
    """The load balancer's https URL (its inventory address, which the issued certificate names), the token and the
    CA certificate."""
    port = int(cluster.setting("loadbalancer_tls_port", "loadbalancer", "loadbalancer"))
    host = cluster.address(cluster.group("loadbalancer")[0])
    host = f"[{host}]" if ":" in host else host
    url = f"https://{host}" if port == 443 else f"https://{host}:{port}"
    return Endpoint(url, load_token(cluster), load_ca(cluster))


@dataclass
class Completion:
    status: int
    seconds: float
    text: str
    body: dict[str, Any]


def complete(ep: Endpoint, prompt: str, *, max_tokens: int = 32, temperature: float = 0.0,
             timeout: float = 30.0) -> Completion:
    """POST /v1/completions (non-streaming) and time it; status -1 when the connection failed."""
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    t = time.monotonic()
    try:
        status, raw = ep.call("POST", "/v1/completions", payload, timeout=timeout)
    except OSError as exc:
        return Completion(-1, time.monotonic() - t, "", {"error": str(exc)})
    seconds = time.monotonic() - t
    try:
        body = json.loads(raw)
    except ValueError:
        body = {"raw": raw[:500].decode(errors="replace")}
    text = (body.get("choices") or [{}])[0].get("text", "") if status == 200 else ""
    return Completion(status, seconds, text, body)
