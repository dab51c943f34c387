"""The one small interface every machine provider implements: launch N, terminate one, list.

Providers know machines, never replicas or endpoints: `endpoints.fleet.pools` decides what to launch
and release, and records it (`NodeLaunch`); a provider only carries it out. Every call is idempotent
on the launch's id, so the policy may repeat one after a crash or a lost answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class ProviderError(Exception):
    """The provider refused or failed; the message is safe to show staff and store in the event log."""


class ProviderUnreachable(ProviderError):
    """No answer came (a timeout, a connection lost): the provider may have done what it was asked or not."""


class NotThisFleets(ProviderError):
    """The machine does not carry this fleet's pool marking, so it is never touched: asking again cannot change that
    (the machine is another fleet's, or `INFERPLANE_FLEET_ID` changed since it was launched)."""


@dataclass(slots=True, frozen=True)
class PoolSpec:
    """What a provider needs of a pool (a plain copy of `NodePool`, so providers test without a database)."""

    id: int
    name: str
    gpu_type: str
    gpus_per_node: int
    gpu_memory_mb: int
    template: dict = field(default_factory=dict)
    # `FleetInstallation.current_id()`: put on every machine launched, and required of a stray ("": never a stray).
    installation_id: str = ""


@dataclass(slots=True, frozen=True)
class LaunchSpec:
    """One machine to start. `launch_id` is the idempotency key; `join_token` is one-use and expires
    at the join deadline; the agent registers at `control_plane_url` under `name`."""

    launch_id: str
    name: str
    join_token: str = field(repr=False)
    control_plane_url: str
    zone: str = ""  # the subnet / zone to use ("" for the template's default)


@dataclass(slots=True, frozen=True)
class LaunchResult:
    launch_id: str
    provider_id: str = ""  # set when the provider accepted it
    zone: str = ""
    error: str = ""  # why it was refused (then provider_id is "")


@dataclass(slots=True, frozen=True)
class Machine:
    """A machine the provider holds for a pool, as it reports it."""

    provider_id: str
    launch_id: str
    state: str  # "pending", "running" or "stopping"; terminated machines are not listed
    node_name: str = ""  # the name its agent registers under, where the provider knows it (Kubernetes)
    # NOTE: it carries the marking this installation's launches set: `INFERPLANE_FLEET_ID` and the pool, and
    # `PoolSpec.installation_id` (EC2's tags, the placeholder's labels, the local agent's record). Only such a machine
    # may be terminated for having no launch record (`endpoints.fleet.pool_strays`); False for one launched before the
    # installation id was put on machines, or by another installation (whatever its fleet id and pool ids).
    fleet_marked: bool = False
    # NOTE: the hosts the fleet's agents on the machine advertise, where the provider can tell (Kubernetes: the IPs of
    # the agent DaemonSet's pods on its node); None when it cannot (EC2, local, the agent pods unreadable). Of the nodes
    # registered under the machine's name, one at such a host is its agent (`pools.link_joins`): a shared join token's
    # holder claiming the name before the agent registered is not (it would have to know the pod's IP too). Empty: the
    # provider can tell, and no agent on the machine has a host yet (its pod not there, or not given an IP): no node
    # registered under the name is its agent yet. Before, that was read as "cannot tell" and the first registered under
    # the name was linked, whatever its host: the window while the agent's pod starts was the takeover's.
    agent_hosts: tuple[str, ...] | None = None
    # NOTE: the machine's agent is known by the pod it runs in (Kubernetes): only a node whose registration carried
    # its pod's service-account token, which the API server's review named as a pod of the agent's account on the node
    # the registration names (`Node.agent_pod_uid`, `kubernetes.reviewed_agent_pod`), is its agent. Before, a shared
    # join token's holder who learned the agent pod's IP (or the node's, for an agent on the host's network) and
    # registered there under the node's name before the agent was linked as the machine.
    pod_bound: bool = False


class Provider(Protocol):
    name: str

    def template_errors(self, template: dict) -> dict[str, list[str]]:
        """Field errors of a pool's template ({} when valid), keyed `template.<field>`."""

    def zones(self, template: dict) -> list[str]:
        """The zones / subnets a launch may go to, in order of preference ([""] when there is no choice)."""

    def launch(self, pool: PoolSpec, specs: list[LaunchSpec]) -> list[LaunchResult]:
        """Start one machine per spec; a spec whose launch id already has a machine returns that machine."""

    def terminate(self, pool: PoolSpec, provider_id: str) -> None:
        """Stop and release the machine; nothing happens if it is already gone."""

    def list(self, pool: PoolSpec) -> list[Machine]:
        """The pool's machines that are not terminated: every page of the provider's listing, or an error (never a
        part of it: the stray sweep terminates what the list shows and no record knows)."""
