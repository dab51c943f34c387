"""Machine providers for node pools (`base.Provider`): `local`, `ec2`, `kubernetes`.

`get_provider(pool.provider)` is the one way to reach them; `pool_spec(pool)` copies what they need
of a `NodePool` (and this installation's id), so they never see the database.
"""

from __future__ import annotations

from endpoints.fleet.providers.base import PoolSpec, Provider
from endpoints.fleet.providers.ec2 import Ec2Provider
from endpoints.fleet.providers.kubernetes import KubernetesProvider
from endpoints.fleet.providers.local import LocalProvider
from endpoints.nodes.models import FleetInstallation, NodePool, PoolProvider

_PROVIDERS: dict[str, Provider] = {
    PoolProvider.LOCAL.value: LocalProvider(),
    PoolProvider.EC2.value: Ec2Provider(),
    PoolProvider.KUBERNETES.value: KubernetesProvider(),
}


def get_provider(name: str) -> Provider:
    """The provider called `name` (a `PoolProvider` value); KeyError for any other name."""
    return _PROVIDERS[str(name)]


def pool_spec(pool: NodePool) -> PoolSpec:
    return PoolSpec(
        id=pool.pk,
        name=pool.name,
        gpu_type=pool.gpu_type,
        gpus_per_node=pool.gpus_per_node,
        gpu_memory_mb=pool.gpu_memory_mb,
        template=dict(pool.template or {}),
        installation_id=FleetInstallation.current_id(),
    )
