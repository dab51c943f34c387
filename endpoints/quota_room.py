"""What an organisation may still place under its replica and GPU quotas (`ReplicaRoom`).

Its own module, beside `endpoints.quotas` (which judges specs, uploads and placement by it): the node pools
(`endpoints.fleet.pools`) read it too, and `quotas` depends on the batch app, which the pools must not.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Sum

from controlplane.accounts.models import Organization, Quotas
from endpoints.models import ACTIVE_REPLICA_STATES, Replica


@dataclass(slots=True)
class ReplicaRoom:
    """What an organisation holds now against its replica and GPU quotas, and so how many more it may place.

    NOTE: the one count both placement (`quotas.replica_refusal`) and the node pools' demand
    (`endpoints.fleet.pools.assign_demand`) judge by: a replica the quota will refuse is no demand for a machine."""

    quotas: Quotas
    num_held: int
    num_gpus_held: dict[str, int]  # GPU type -> GPUs its replicas hold (a tensor-parallel one holds several)

    def num_more(self, gpu_type: str, gpus_per_replica: int) -> int:
        """How many more replicas of that shape the organisation may hold now."""
        by_replicas = self.quotas.max_replicas - self.num_held
        by_gpus = (self.quotas.max_gpus(gpu_type) - self.num_gpus_held.get(gpu_type, 0)) // max(1, gpus_per_replica)
        return max(0, min(by_replicas, by_gpus))

    def take(self, gpu_type: str, gpus_per_replica: int, num_replicas: int) -> None:
        """Count `num_replicas` more as held (a demand already given a machine)."""
        self.num_held += num_replicas
        self.num_gpus_held[gpu_type] = self.num_gpus_held.get(gpu_type, 0) + num_replicas * gpus_per_replica


def replica_room(organization: Organization) -> ReplicaRoom:
    """The organisation's `ReplicaRoom` now (two queries)."""
    held = Replica.objects.filter(endpoint__organization_id=organization.pk, state__in=ACTIVE_REPLICA_STATES).order_by()
    # NOTE: GPUs, not replicas: a tensor-parallel replica holds gpus_per_replica of them.
    gpus = dict(held.values("endpoint__gpu_type").annotate(num=Sum("endpoint__gpus_per_replica"))
                .values_list("endpoint__gpu_type", "num"))
    return ReplicaRoom(organization.quotas, held.count(), {gpu_type: num or 0 for gpu_type, num in gpus.items()})
