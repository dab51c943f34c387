"""The agent's side of the agent API: the node's identity, registration, heartbeats and the watch.

    POST /agent/v1/register   RegisterRequest  -> RegisterResponse
    POST /agent/v1/heartbeat  Heartbeat        -> HeartbeatResponse (Bearer <node secret>)
    POST /agent/v1/watch                       -> WatchResponse     (Bearer <node secret>)

The node id and secret are kept in `<data-dir>/node.json`, so a restarted agent is the same node.
A heartbeat's 401 is answered by its `error.code` (`protocol.NODE_REFUSED`, `NODE_UNKNOWN`, `NODE_RETIRED`: what each
means and does is noted there, in one place): `NODE_UNKNOWN` (the control plane forgot the node) registers again with
the join token, at most once a `REREGISTER_MIN_INTERVAL_S`; `NODE_REFUSED` (its own secret accepted, the node refused)
is `RegistrationRefused.node_refused`, as is a registration's 400 with that code; `NODE_RETIRED` (the very secret of a
retired node) is `RegistrationRefused.node_retired`; any other 401 (something between them dropped the secret, an
older control plane) is `HeartbeatUnauthorized`, retried with back-off. A refusal of a registration (400, 401, 403) is
`RegistrationRefused`, logged with the reason. Only a refusal of the node itself (refused or retired) stops its
engines (`Agent.heartbeat_once`); any other leaves them serving while the agent retries. What to report and what to do
with the answer is the agent loop's (`agent`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import httpx

from gpu_agent.protocol import (
    MAX_POD_TOKEN_CHARS,
    NODE_REFUSED,
    NODE_RETIRED,
    NODE_UNKNOWN,
    REREGISTER_MIN_INTERVAL_S,
    RETIRED_NO_REREGISTER_S,
    Heartbeat,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    WatchResponse,
)
from gpu_agent.runtime import durable, engine, sandbox
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.hardware import HardwareReport

logger = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
WATCH_TIMEOUT_S = 35.0  # the control plane answers a watch within 25 s
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S = 0.2, 60.0


RETIRED_KEPT_REFRESH_S = 3600.0  # how stale `node.json`'s record of it may get while the answers say so


def heartbeat_interval(value) -> float:
    """The interval the control plane asks for, within bounds; the default for anything but a finite number. NOTE: a
    null raised out of the heartbeat loop and the agent stopped every tenant's engine; 0 or NaN had it beat flat
    out, infinity never again."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return DEFAULT_HEARTBEAT_INTERVAL_S
    return min(max(float(value), MIN_HEARTBEAT_INTERVAL_S), MAX_HEARTBEAT_INTERVAL_S)


# A Kubernetes pool's agent pod's projected service-account token (infra/k8s/components/node-pools), sent on
# registration: the control plane has the API server review it, which binds the node to this pod. Read at each
# registration, as the kubelet renews it; absent on bare metal (nothing sent).
POD_TOKEN_FILE = Path("/var/run/secrets/inferplane.dev/registration/token")


def pod_token() -> str:
    """The pod's token, "" where there is none (bare metal) or none that can be sent, which is logged: a pool then does
    not link the node. NOTE: at most a token's worth is read, and a file that is too long, not UTF-8 or holds control
    characters is no token. Before, a huge file was read whole at each registration, and it or an undecodable one
    raised in building the request: the node never registered, pooled or not; an unreadable one was dropped silently."""
    try:
        with POD_TOKEN_FILE.open("rb") as token_file:
            raw = token_file.read(MAX_POD_TOKEN_CHARS + 2)  # a token of the most characters, and a newline
    except FileNotFoundError:
        return ""
    except OSError as error:
        logger.warning("pod token %s unreadable (%s): registering without it", POD_TOKEN_FILE, error.strerror or error)
        return ""
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        token = None
    if token is None or len(raw) > MAX_POD_TOKEN_CHARS + 1 or len(token) > MAX_POD_TOKEN_CHARS or not token.isprintable():
        logger.warning("pod token %s is not a token (longer than %d characters, not UTF-8 or holding control "
                       "characters): registering without it", POD_TOKEN_FILE, MAX_POD_TOKEN_CHARS)
        return ""
    return token


class RegistrationRefused(Exception):
    """The control plane refused the registration: `node_refused` when it refuses this node, its host or engine ports
    (the answer's `protocol.NODE_REFUSED` code); `node_retired` when a heartbeat's secret is a retired node's
    (`protocol.NODE_RETIRED`); else the join token (invalid, expired, used up, revoked), or whatever
    answered was no control plane that knows this fleet (a proxy's 403, another environment's 401).

    NOTE: a pool's machine joins with a one-use token and a rotation revokes the old one, so a token that no longer
    admits anyone is the usual state of a running node: its refusal says nothing of the node."""

    def __init__(self, message: str, *, node_refused: bool = False, node_retired: bool = False) -> None:
        super().__init__(message)
        self.node_refused = node_refused
        self.node_retired = node_retired


class HeartbeatUnauthorized(httpx.HTTPError):
    """A heartbeat's 401 that says nothing of the node: no `error.code` (no secret reached the control plane, or it is
    older than protocol 4), or `NODE_UNKNOWN` sooner than `REREGISTER_MIN_INTERVAL_S` after the last registration.
    Retried with back-off (an `httpx.HTTPError`), the engines serving and the node secret kept."""


def _error_code(response: httpx.Response) -> str:
    """The agent API's `error.code` of a refusal ("" when it has none, or the body is not the API's)."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else ""


class ControlPlaneClient:
    """Speaks for one node: registers it (once per control plane and engine address) and reports it."""

    def __init__(
        self,
        config: AgentConfig,
        machine: HardwareReport,
        *,
        device: str,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        self.machine = machine
        self.device = device
        self.http = httpx.Client(
            base_url=config.control_plane_url, timeout=config.request_timeout_s, transport=transport
        )
        self._transport = transport
        self.credentials_path = config.data_dir / "node.json"
        self.node_id: str | None = None
        self.node_secret: str | None = None
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self._registered_at = -math.inf  # `time.monotonic()` of this process's last registration
        self._retired_at: float | None = None  # `time.time()` the node was last told retired (kept in `node.json`)
        self._load_credentials()

    def _load_credentials(self) -> None:
        durable.remove_leftovers(self.credentials_path)  # a write killed before its rename (`durable.write_atomic`)
        try:
            data = json.loads(self.credentials_path.read_text())
            # The node was registered with this control plane, host and port range; if the operator
            # changed either, register again so the control plane trusts the new address.
            if data.get("control_plane_url") == self.config.control_plane_url and data.get(
                "engine_address"
            ) == self._engine_address():
                self.node_id, self.node_secret = data["node_id"], data["node_secret"]
                retired_at = data.get("retired_at")
                self._retired_at = float(retired_at) if isinstance(retired_at, (int, float)) else None
        except (OSError, ValueError, KeyError):
            pass

    def _engine_address(self) -> list:
        return [self.config.advertise_host, *self.config.engine_ports]

    def register(self) -> RegisterResponse:
        request = RegisterRequest(
            pod_token=pod_token(),
            join_token=self.config.join_token,
            name=self.config.name,
            gpu_type=self.machine.gpu_type,
            num_gpus=self.machine.num_gpus,
            gpu_memory_mb=self.machine.gpu_memory_mb,
            num_cpus=self.machine.num_cpus,
            memory_mb=self.machine.memory_mb,
            agent_version=AGENT_VERSION,
            engine_version=engine.engine_version(),
            supported_quantizations=sorted(engine.supported_quantizations(self.device)),
            advertise_host=self.config.advertise_host,
            engine_port_min=self.config.engine_ports[0],
            engine_port_max=self.config.engine_ports[1],
            gpus=list(self.machine.gpus),
            engine_sandbox=sandbox.node_fact(self.config.engine_sandbox),
        )
        self._registered_at = time.monotonic()
        response = self.http.post("/agent/v1/register", json=request.to_dict())
        if response.status_code in (400, 401, 403):
            raise RegistrationRefused(f"register refused ({response.status_code}): {response.text[:200]}",
                                      node_refused=_error_code(response) == NODE_REFUSED)
        response.raise_for_status()
        answer = RegisterResponse.from_dict(response.json())
        self.node_id, self.node_secret = answer.node_id, answer.node_secret
        self.heartbeat_interval_s = heartbeat_interval(answer.heartbeat_interval_s)
        self._retired_at = None
        self._save_credentials()
        logger.info("registered as node %s (%s)", answer.node_id, self.machine.gpu_type)
        return answer

    def _save_credentials(self) -> None:
        data = {
            "control_plane_url": self.config.control_plane_url,
            "node_id": self.node_id,
            "node_secret": self.node_secret,
            "engine_address": self._engine_address(),
        }
        if self._retired_at is not None:
            data["retired_at"] = self._retired_at
        # NOTE: durably (`durable`): a power loss right after a registration left an empty node.json, and the next
        # agent registered as a new node.
        durable.write_atomic(self.credentials_path, json.dumps(data), mode=0o600)

    def _told_retired(self) -> None:
        """Remember, in `node.json` (a restart does not forget), that the control plane said this node is retired."""
        if self._retired_at is not None and time.time() - self._retired_at < RETIRED_KEPT_REFRESH_S:
            return
        self._retired_at = time.time()
        try:
            self._save_credentials()
        except OSError:
            logger.exception("could not keep in %s that this node is retired", self.credentials_path)

    def _retired_recently(self) -> bool:
        return self._retired_at is not None and time.time() - self._retired_at < RETIRED_NO_REREGISTER_S

    def register_if_needed(self) -> None:
        if self.node_secret is None:
            self.register()

    def send_heartbeat(self, heartbeat: Heartbeat) -> HeartbeatResponse:
        """Send one heartbeat, registering again if the control plane says it forgot the node (`NODE_UNKNOWN`).
        Raises `RegistrationRefused` (`node_refused`) when it refuses the node, (`node_retired`) when the node is
        retired, `HeartbeatUnauthorized` for a 401 that says none of these."""
        response = self._post_heartbeat(heartbeat)
        if response.status_code == 401 and _error_code(response) == NODE_UNKNOWN and self._retired_recently():
            # NOTE: a web pod older than protocol 5 (a rolling deploy) answers a retired secret `NODE_UNKNOWN`: a
            # node told retired never registers again under a join token still open (`RETIRED_NO_REREGISTER_S`).
            raise RegistrationRefused(f"this node was told it is retired; now unknown (401): {response.text[:200]}",
                                      node_retired=True)
        if response.status_code == 401 and self._unknown_node_may_register(response):
            logger.warning("heartbeat refused (401, %s): registering again", NODE_UNKNOWN)
            self.register()
            response = self._post_heartbeat(heartbeat)
        if response.status_code == 401:
            if _error_code(response) == NODE_REFUSED:
                raise RegistrationRefused(f"heartbeat refused (401): {response.text[:200]}", node_refused=True)
            if _error_code(response) == NODE_RETIRED:
                self._told_retired()
                raise RegistrationRefused(f"this node is retired (401): {response.text[:200]}", node_retired=True)
            raise HeartbeatUnauthorized(f"heartbeat refused (401), retrying: {response.text[:200]}")
        response.raise_for_status()
        answer = HeartbeatResponse.from_dict(response.json())
        self.heartbeat_interval_s = heartbeat_interval(answer.heartbeat_interval_s)
        return answer

    def _unknown_node_may_register(self, response: httpx.Response) -> bool:
        """Whether a heartbeat's 401 is `NODE_UNKNOWN` and this process registered no sooner than
        `REREGISTER_MIN_INTERVAL_S` ago: a control plane that forgets each new node at once gets one a minute."""
        return _error_code(response) == NODE_UNKNOWN and (
            time.monotonic() - self._registered_at >= REREGISTER_MIN_INTERVAL_S)

    def _post_heartbeat(self, heartbeat: Heartbeat) -> httpx.Response:
        return self.http.post(
            "/agent/v1/heartbeat",
            json=heartbeat.to_dict(),
            headers={"Authorization": f"Bearer {self.node_secret}"},
        )

    def watch(self, stop: threading.Event, on_change) -> None:
        """Long-poll `/agent/v1/watch` until `stop`, calling `on_change()` when the node's desired state changed.

        A new or drained replica is so heard of at once, not at the next heartbeat.
        """
        failures = 0
        with httpx.Client(
            base_url=self.config.control_plane_url, timeout=WATCH_TIMEOUT_S, transport=self._transport
        ) as client:
            while not stop.is_set():
                if not self.node_secret:
                    stop.wait(0.2)
                    continue
                try:
                    response = client.post(
                        "/agent/v1/watch", headers={"Authorization": f"Bearer {self.node_secret}"}
                    )
                    if response.status_code == 404:  # an older control plane: heartbeats alone will do
                        return
                    response.raise_for_status()
                    failures = 0
                    if WatchResponse.from_dict(response.json()).changed:
                        on_change()
                except (httpx.HTTPError, ValueError):
                    failures += 1
                    stop.wait(self.config.backoff_s(failures))

    def close(self) -> None:
        self.http.close()
