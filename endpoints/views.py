"""Console pages for endpoints: dashboard, deploy wizard, endpoint page (live parts, metrics, playground),
and the organisation's model credentials."""

from __future__ import annotations

from datetime import UTC, timedelta

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from billing.ledger import BUCKET_ORIGIN, period_spend, summarize_usage, usage_by_bucket
from billing.periods import current_period
from controlplane.accounts.console import member_required
from controlplane.accounts.models import Role
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.services import Actor
from controlplane.integrity import again_after_deadlocks
from controlplane.plain_numbers import plain_int
from endpoints import credentials, prewarm, quota_room, quotas, services, stats
from endpoints.adapters import adapters_with_holders
from endpoints.catalogue import GPU_TYPES, GPUS_PER_REPLICA, QUANTIZATIONS
from endpoints.forms import CredentialForm, EndpointForm
from endpoints.models import Endpoint, ModelCredential, shown_replicas_prefetch
from endpoints.nodes.models import Node
from endpoints.placement import memory_needed_mb, smallest_gpu_count
from endpoints.serializers import CredentialSerializer, EndpointSerializer

NUM_EVENTS_SHOWN = 50
METRIC_WINDOWS_MIN = {60: 60, 360: 300, 1440: 900}  # window (minutes) -> bucket (seconds)


def _endpoints(organization):
    return Endpoint.objects.for_org(organization).prefetch_related(*shown_replicas_prefetch())


def _endpoint_or_404(request, pk):
    return get_object_or_404(_endpoints(request.organization), pk=pk)


# --- dashboard ------------------------------------------------------------------------


def _usage_summary(organization) -> dict:
    """Today's (UTC) requests and tokens, and this billing period's spend, from the usage ledger."""
    today = timezone.now().astimezone(UTC).date()
    rows = summarize_usage(organization, group_by="day", start=today, end=today)
    period = current_period()
    return {
        "requests": sum(row["requests"] for row in rows),
        "tokens": sum(row["prompt_tokens"] + row["completion_tokens"] for row in rows),
        "spend_period": period_spend(organization.pk, period),
        "period": period,
    }


@member_required()
def dashboard(request):
    return render(request, "endpoints/dashboard.html", {
        "endpoints": _endpoints(request.organization),
        "usage": _usage_summary(request.organization),
        "can_write": request.membership.can(Role.MEMBER),
    })


@member_required()
def endpoint_list(request):
    return render(request, "endpoints/endpoint_list.html", {
        "endpoints": _endpoints(request.organization),
        "can_write": request.membership.can(Role.MEMBER),
        "quota_use": quotas.use_of(request.organization),
    })


@member_required()
def endpoints_live(request):
    """The endpoints table alone, polled by htmx so states change without a reload."""
    return render(request, "endpoints/_endpoint_table.html", {"endpoints": _endpoints(request.organization)})


# --- deploy wizard and edit -------------------------------------------------------------


def _wizard(request, form, *, endpoint=None, status=200):
    ready_nodes = {}
    for node in Node.objects.placeable():
        ready_nodes[node.gpu_type] = ready_nodes.get(node.gpu_type, 0) + 1
    selected = form["gpu_type"].value()
    gpus = [{"gpu": gpu, "num_ready_nodes": ready_nodes.get(name, 0), "selected": name == selected}
            for name, gpu in GPU_TYPES.items()]
    return render(request, "endpoints/endpoint_form.html", {
        "form": form, "endpoint": endpoint, "gpus": gpus, "suggestion": gpu_suggestion(form_values(form)),
    }, status=status)


def form_values(form: EndpointForm) -> dict:
    return {name: form[name].value() for name in ("model_source", "gpu_type", "quantization", "max_model_len", "max_num_seqs")}


def _positive(value, default):
    try:
        number = int(value)
    except (TypeError, ValueError):
        return default
    return number if 0 < number <= 10_000_000 else default


def gpu_suggestion(values: dict) -> dict | None:
    """The smallest GPUs per replica that hold the model and its context, for the wizard (None: nothing to say yet)."""
    source = str(values.get("model_source") or "").strip()[:500]
    # NOTE: the source is looked up in the sizes nodes reported, and PostgreSQL refuses NUL: one the form has yet to
    # refuse made the wizard a 500.
    if not source or "\x00" in source or values.get("gpu_type") not in GPU_TYPES:
        return None
    spec = Endpoint(
        model_source=source, gpu_type=values["gpu_type"],
        quantization=values.get("quantization") if values.get("quantization") in QUANTIZATIONS else "none",
        max_model_len=_positive(values.get("max_model_len"), None), max_num_seqs=_positive(values.get("max_num_seqs"), 64),
    )
    needed_mb = memory_needed_mb(spec)
    gpu = GPU_TYPES[spec.gpu_type]
    return {
        "count": smallest_gpu_count(spec, needed_mb), "needed_gb": round(needed_mb / 1024, 1), "gpu_label": gpu.label,
        "gpu_gb": gpu.memory_gb, "most": 1 if spec.gpu_type == "cpu" else GPUS_PER_REPLICA[-1],
    }


def _default_gpu_type() -> str:
    # A platform with capacity of one kind (a CPU development box) gets that kind pre-selected.
    return next((node.gpu_type for node in Node.objects.placeable()), "l4")


@member_required(write=Role.MEMBER)
def endpoint_new(request):
    if request.method != "POST":
        initial = EndpointForm.initial_for() | {"gpu_type": _default_gpu_type()}
        return _wizard(request, EndpointForm(initial=initial, organization=request.organization))
    form = EndpointForm(request.POST, organization=request.organization)
    serializer = EndpointSerializer(data=form.serializer_data(request.POST), context={"organization": request.organization})
    if not serializer.is_valid():
        form.show_errors(serializer.errors)
        return _wizard(request, form, status=400)
    try:
        endpoint = services.create_endpoint(Actor.from_request(request), request.organization, **serializer.validated_data)
    except ValidationError as exc:  # another request took the last of the quota, or the name, meanwhile
        form.show_errors(exc.detail)
        return _wizard(request, form, status=400)
    # NOTE: an organisation held to the idle cap keeps no warm floor (`autoscaler.floor`): no replica starts now for it.
    floor_held = endpoint.min_replicas and request.organization.pk in quota_room.idle_caps([request.organization.pk])
    messages.success(request, f"{endpoint.name} is deployed. It starts on the first request" + (
        "." if not endpoint.min_replicas else
        "; its minimum replicas stay warm once the organisation has a payment method." if floor_held else
        " and now, for its minimum replicas."))
    return redirect("console:endpoint", pk=endpoint.pk)


@member_required(write=Role.MEMBER)
def endpoint_edit(request, pk):
    if request.method != "POST":
        endpoint = _endpoint_or_404(request, pk)
        initial = EndpointForm.initial_for(endpoint)
        return _wizard(request, EndpointForm(initial=initial, organization=request.organization), endpoint=endpoint)
    return again_after_deadlocks(lambda: _edit_locked(request, pk),
                                 wait_for=lambda: services.wait_for_endpoint_row(pk))


def _edit_locked(request, pk):
    with transaction.atomic():  # NOTE: checked against the row as it is (`integrity.RowLockedUpdateMixin`)
        quotas.lock_organization(request.organization.pk)  # NOTE: before the endpoint's, as `services.update_endpoint`
        return _save_endpoint_edit(request, get_object_or_404(_endpoints(request.organization).select_for_update(
            of=("self",), no_key=True), pk=pk))


def _save_endpoint_edit(request, endpoint):
    form = EndpointForm(request.POST, organization=request.organization)
    serializer = EndpointSerializer(
        endpoint, data=form.serializer_data(request.POST), context={"organization": request.organization}
    )
    if not serializer.is_valid():
        form.show_errors(serializer.errors)
        return _wizard(request, form, endpoint=endpoint, status=400)
    try:
        services.update_endpoint(Actor.from_request(request), endpoint, **serializer.validated_data)
    except ValidationError as exc:
        form.show_errors(exc.detail)
        return _wizard(request, form, endpoint=endpoint, status=400)
    messages.success(request, "Configuration saved. Replicas pick it up as they restart.")
    return redirect("console:endpoint", pk=endpoint.pk)


@member_required()
def gpus_field(request):
    """The GPUs-per-replica select with the smallest count that fits (htmx swaps it in as the spec changes)."""
    form = EndpointForm(initial={"gpus_per_replica": request.GET.get("gpus_per_replica", "1")})
    return render(request, "endpoints/_gpus_field.html",
                  {"field": form["gpus_per_replica"], "suggestion": gpu_suggestion(request.GET)})


@member_required()
def quantization_field(request):
    """The quantization select for a GPU type (htmx swaps it in when the GPU type changes)."""
    form = EndpointForm(initial={"quantization": request.GET.get("quantization", "none")},
                        gpu_type=request.GET.get("gpu_type"))
    return render(request, "endpoints/_quantization_field.html", {"field": form["quantization"]})


# --- model credentials ----------------------------------------------------------------------
# Members see the list (to pick a credential for an endpoint); admins and owners change it.


def _credentials_page(request, form, status=200):
    if not request.membership.can(Role.MEMBER):
        raise PermissionDenied("This needs the member role or higher.")
    return render(request, "endpoints/credentials.html", {
        "credentials": ModelCredential.objects.filter(organization=request.organization)
        .select_related("created_by").prefetch_related("endpoints"),
        "form": form,
        "can_write": request.membership.can(Role.ADMIN),
    }, status=status)


def _credential_or_404(request, pk):
    return get_object_or_404(ModelCredential.objects.filter(organization=request.organization), pk=pk)


@member_required(write=Role.ADMIN)
def credential_list(request):
    if request.method != "POST":
        return _credentials_page(request, CredentialForm(initial={"kind": "s3"}))
    form = CredentialForm(request.POST)
    serializer = CredentialSerializer(data=form.serializer_data(request.POST), context={"organization": request.organization})
    if not serializer.is_valid():
        form.show_errors(serializer.errors)
        return _credentials_page(request, form, status=400)
    try:
        credential = credentials.create_credential(Actor.from_request(request), request.organization, **serializer.validated_data)
    except ValidationError as exc:  # the name was taken meanwhile
        form.show_errors(exc.detail)
        return _credentials_page(request, form, status=400)
    messages.success(request, f"Credential {credential.name} saved. Its secrets are stored encrypted and are never shown again.")
    return redirect("console:credential-edit", pk=credential.pk)


@member_required(write=Role.ADMIN)
def credential_edit(request, pk):
    if not request.membership.can(Role.ADMIN):
        raise PermissionDenied("This needs the admin role or higher.")
    if request.method != "POST":
        credential = _credential_or_404(request, pk)
        fields = ("name",) + credentials.PUBLIC_FIELDS[credential.kind]
        form = CredentialForm(initial={name: getattr(credential, name) for name in fields})
        return _credential_page(request, credential, form)
    with transaction.atomic():  # NOTE: checked against the row as it is (`integrity.RowLockedUpdateMixin`)
        return _save_credential_edit(request, get_object_or_404(
            ModelCredential.objects.filter(organization=request.organization).select_for_update(), pk=pk))


def _save_credential_edit(request, credential):
    form = CredentialForm(request.POST)
    serializer = CredentialSerializer(credential, data=form.serializer_data(request.POST), partial=True,
                                      context={"organization": request.organization})
    if not serializer.is_valid():
        form.show_errors(serializer.errors)
        return _credential_page(request, credential, form, status=400)
    try:
        credentials.update_credential(Actor.from_request(request), credential, **serializer.validated_data)
    except ValidationError as exc:  # the name was taken meanwhile
        form.show_errors(exc.detail)
        return _credential_page(request, credential, form, status=400)
    messages.success(request, f"Credential {credential.name} saved.")
    return redirect("console:credential-edit", pk=credential.pk)


def _credential_page(request, credential, form, status=200):
    return render(request, "endpoints/credential_edit.html", {
        "credential": credential, "form": form,
        "fields": [form[name] for name in ("name",) + credentials.PUBLIC_FIELDS[credential.kind]],
        "secret_fields": [form[name] for name in credentials.SECRETS_OF_KIND[credential.kind]],
        "endpoints": Endpoint.objects.live().filter(credential=credential),
    }, status=status)


@member_required(write=Role.ADMIN)
@require_POST
def credential_delete(request, pk):
    credential = _credential_or_404(request, pk)
    try:
        credentials.delete_credential(Actor.from_request(request), credential)
    except credentials.CredentialInUse as exc:
        messages.error(request, str(exc))
        return redirect("console:credential-edit", pk=credential.pk)
    messages.success(request, f"Credential {credential.name} was deleted.")
    return redirect("console:credentials")


# --- endpoint page --------------------------------------------------------------------------


def _live_context(request, endpoint) -> dict:
    alive, ended = endpoint.shown_replicas()
    return {
        "endpoint": endpoint,
        "replicas": alive + ended,
        "shows_nodes": request.membership.can(Role.ADMIN),  # which node runs a replica: owners and admins, as the API
        "num_alive": len(alive),
        "events": endpoint.events.select_related("replica")[:NUM_EVENTS_SHOWN],
    }


@member_required()
def endpoint_detail(request, pk):
    endpoint = _endpoint_or_404(request, pk)
    now = timezone.now()
    return render(request, "endpoints/endpoint_detail.html", _live_context(request, endpoint) | {
        "prewarm_windows": prewarm.next_openings(endpoint.prewarm_windows, now),
        "open_windows": prewarm.open_windows(endpoint.prewarm_windows, now),
        "gpu": GPU_TYPES.get(endpoint.gpu_type),
        "can_write": request.membership.can(Role.MEMBER),
        "public_url": settings.PUBLIC_URL,
        "metric_windows": list(METRIC_WINDOWS_MIN),
        "cold_starts": stats.chart(stats.recent_cold_starts(endpoint)),
        "cost_days": stats.daily(endpoint, start=now.date() - timedelta(days=stats.DEFAULT_DAYS - 1), end=now.date(),
                                 staff=has_staff_powers(request.user)),
        "show_margin": has_staff_powers(request.user),
        "adapters": adapters_with_holders(endpoint),
    })


@member_required()
def endpoint_live(request, pk):
    endpoint = _endpoint_or_404(request, pk)
    return render(request, "endpoints/_endpoint_live.html", _live_context(request, endpoint))


@member_required(write=Role.MEMBER)
@require_POST
def endpoint_pause(request, pk):
    endpoint = services.pause_endpoint(Actor.from_request(request), _endpoint_or_404(request, pk))
    messages.success(request, f"{endpoint.name} is paused: its replicas drain and calls get 503 until you resume it.")
    return redirect("console:endpoint", pk=endpoint.pk)


@member_required(write=Role.MEMBER)
@require_POST
def endpoint_resume(request, pk):
    endpoint = services.resume_endpoint(Actor.from_request(request), _endpoint_or_404(request, pk))
    messages.success(request, f"{endpoint.name} is resumed.")
    return redirect("console:endpoint", pk=endpoint.pk)


@member_required(write=Role.MEMBER)
def endpoint_delete(request, pk):
    endpoint = _endpoint_or_404(request, pk)
    if request.method == "POST":
        if request.POST.get("confirm_name") != endpoint.name:
            return render(request, "endpoints/endpoint_delete.html",
                          {"endpoint": endpoint, "error": "Type the endpoint's name exactly to confirm."}, status=400)
        services.delete_endpoint(Actor.from_request(request), endpoint)
        messages.success(request, f"{endpoint.name} was deleted. Its usage stays on your invoices.")
        return redirect("console:endpoints")
    return render(request, "endpoints/endpoint_delete.html", {"endpoint": endpoint})


# --- metrics ----------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@member_required()
def endpoint_metrics(request, pk):
    """Series for the endpoint page's charts: requests, latency p50/p95, tokens/s and replicas per bucket.

    `?minutes=60|360|1440` (buckets of 1, 5 and 15 minutes). `t` holds bucket starts in Unix
    seconds; a bucket without requests has zero requests and null latencies.
    """
    endpoint = _endpoint_or_404(request, pk)
    minutes = plain_int(request.GET.get("minutes", ""))
    minutes = minutes if minutes in METRIC_WINDOWS_MIN else 60
    bucket_s = METRIC_WINDOWS_MIN[minutes]
    now = timezone.now()
    num_buckets = minutes * 60 // bucket_s
    last = BUCKET_ORIGIN + timedelta(seconds=(now - BUCKET_ORIGIN).total_seconds() // bucket_s * bucket_s)
    starts = [last - timedelta(seconds=bucket_s * i) for i in reversed(range(num_buckets))]
    usage = usage_by_bucket(endpoint, since=starts[0], bucket_s=bucket_s)
    lifetimes = list(endpoint.replicas.exclude(stopped_at__lt=starts[0]).values_list("created_at", "stopped_at"))

    series = {"t": [], "requests": [], "p50_ms": [], "p95_ms": [], "tokens_per_s": [], "replicas": []}
    for start in starts:
        end = start + timedelta(seconds=bucket_s)
        row = usage.get(start, {})
        series["t"].append(int(start.timestamp()))
        series["requests"].append(row.get("requests", 0))
        series["p50_ms"].append(_ms(row.get("p50")))
        series["p95_ms"].append(_ms(row.get("p95")))
        series["tokens_per_s"].append(round(row.get("completion_tokens", 0) / bucket_s, 3))
        series["replicas"].append(sum(1 for created, stopped in lifetimes if created < end and (stopped is None or stopped >= start)))
    return JsonResponse({"minutes": minutes, "bucket_s": bucket_s, "series": series})
