"""Node pools on the fleet console (staff only): create, edit, delete; the fleet page lists them.

Parse with `NodePoolForm`, change through `pool_services`, render: the same rules as the API.
"""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from controlplane.accounts.console import staff_required
from controlplane.accounts.services import Actor
from endpoints.fleet import pool_services
from endpoints.fleet.forms import NodePoolForm
from endpoints.fleet.pool_costs import usage_by_pool
from endpoints.nodes.models import NodeLaunch, NodePool

NUM_LAUNCHES_SHOWN = 50


def pools_context() -> dict:
    """The fleet page's node pools (with this month's usage) and their latest launches."""
    pools = list(NodePool.objects.all())
    usage = usage_by_pool(pools)
    for pool in pools:
        pool.usage = usage[pool.pk]
    recent = NodeLaunch.objects.select_related("pool", "node")[:NUM_LAUNCHES_SHOWN]
    return {"pools": pools, "launches": recent}


def _form_page(request, form, pool=None, status=200):
    return render(request, "gpu_agent/pool_form.html", {"form": form, "pool": pool}, status=status)


@staff_required
def pool_new(request):
    if request.method != "POST":
        return _form_page(request, NodePoolForm())
    form = NodePoolForm(request.POST)
    pool = form.save(Actor.from_request(request))
    if pool is None:
        return _form_page(request, form, status=400)
    messages.success(request, f"Node pool {pool.name} created.")
    return redirect("console:fleet")


@staff_required
def pool_edit(request, pk):
    if request.method != "POST":
        pool = get_object_or_404(NodePool, pk=pk)
        return _form_page(request, NodePoolForm(pool=pool), pool)
    # NOTE: the pool read, compared with what the page showed and saved under its row's lock (`stale_edits`): two
    # saves at once both passed the comparison, and the second overwrote the first.
    with transaction.atomic():
        pool = get_object_or_404(NodePool.objects.select_for_update(no_key=True), pk=pk)
        form = NodePoolForm(request.POST, pool=pool)
        saved = form.save(Actor.from_request(request))
    if saved is None:
        return _form_page(request, form, pool, status=400)
    messages.success(request, f"Node pool {pool.name} saved.")
    return redirect("console:fleet")


@staff_required
@require_POST
def pool_delete(request, pk):
    pool = get_object_or_404(NodePool, pk=pk)
    try:
        pool_services.delete_node_pool(Actor.from_request(request), pool)
    except pool_services.PoolInUse as exc:
        messages.error(request, str(exc))
        return redirect("console:pool-edit", pk=pool.pk)
    messages.success(request, f"Node pool {pool.name} deleted.")
    return redirect("console:fleet")
