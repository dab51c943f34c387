"""Queued batch work per endpoint, read for the autoscaler tick in one query (`read_demand`)."""

from __future__ import annotations

from django.db.models import F, Min, Sum

from endpoints.batches.models import Batch, BatchStatus
from endpoints.batches.scheduling import BatchDemand


def read_demand(endpoint_ids: list[str] | None = None) -> dict[str, BatchDemand]:
    """Pending lines and earliest deadline of the running batches of each endpoint (all with work if None)."""
    batches = Batch.objects.filter(status=BatchStatus.IN_PROGRESS, endpoint__isnull=False)
    if endpoint_ids is not None:
        batches = batches.filter(endpoint_id__in=endpoint_ids)
    rows = (batches.order_by().values("endpoint_id")
            .annotate(pending=Sum(F("num_total") - F("num_completed") - F("num_failed")), deadline=Min("expires_at")))
    return {str(row["endpoint_id"]): BatchDemand(max(0, row["pending"] or 0), row["deadline"].timestamp())
            for row in rows if (row["pending"] or 0) > 0}
