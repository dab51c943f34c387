"""Console pages for batches: upload a JSONL file and start a batch, follow its progress (live), download
its output and error files, cancel it. They call the same services as `/v1/files` and `/v1/batches`."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_POST

from controlplane.accounts.console import member_required
from controlplane.accounts.models import Role
from endpoints.batches import services, storage
from endpoints.batches.models import BATCH_PATHS, Batch, BatchStatus, File, FilePurpose
from endpoints.models import EndpointEvent, EventKind

NUM_BATCHES_SHOWN = 50


class BatchForm(forms.Form):
    file = forms.FileField(label="Requests (JSONL)", help_text="One request per line: custom_id, method, url, body.")
    endpoint = forms.ChoiceField(label="Endpoint path", choices=[(path, path) for path in BATCH_PATHS])


def _batch_or_404(request, batch_id: str) -> Batch:
    batch = Batch.objects.for_org(request.organization.pk).select_related("endpoint").named(batch_id).first()
    if batch is None:
        raise Http404("No such batch.")
    return batch


@member_required()
def batch_list(request):
    form = BatchForm()
    if request.method == "POST":
        form = BatchForm(request.POST, request.FILES)
        if form.is_valid():
            upload = form.cleaned_data["file"]
            try:
                input_file = services.create_file(organization_id=request.organization.pk, purpose=FilePurpose.BATCH,
                                                  filename=upload.name, stream=upload, size=upload.size)
                batch = services.create_batch(organization_id=request.organization.pk, api_key_id=None,
                                              user_id=request.user.pk, input_file_id=input_file.pk,
                                              request_path=form.cleaned_data["endpoint"], completion_window="24h",
                                              metadata=None)
            except services.Refused as exc:
                form.add_error("file", exc.message)
            else:
                messages.success(request, f"Batch {batch.pk} created: its lines are being checked.")
                return redirect("console:batch", batch_id=batch.pk)
    batches = Batch.objects.for_org(request.organization.pk).select_related("endpoint").order_by("-created_at")
    return render(request, "batches/batch_list.html", {
        "batches": batches[:NUM_BATCHES_SHOWN], "form": form, "can_write": request.membership.can(Role.MEMBER),
        "max_mb": settings.FILES_MAX_BYTES // (1024 * 1024),
    }, status=400 if form.errors else 200)


def _detail_context(request, batch: Batch) -> dict:
    events = (EndpointEvent.objects.filter(endpoint=batch.endpoint, kind=EventKind.BATCH).order_by("-created_at")[:10]
              if batch.endpoint_id else [])
    done = batch.num_completed + batch.num_failed
    return {"batch": batch, "events": events, "is_open": batch.status not in
            (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED),
            "percent": round(100 * done / batch.num_total) if batch.num_total else 0,
            "can_download": request.membership.can(Role.MEMBER),
            "can_cancel": request.membership.can(Role.MEMBER) and batch.status in
            (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)}


@member_required()
def batch_detail(request, batch_id: str):
    return render(request, "batches/batch_detail.html", _detail_context(request, _batch_or_404(request, batch_id)))


@member_required()
def batch_live(request, batch_id: str):
    return render(request, "batches/_batch_progress.html", _detail_context(request, _batch_or_404(request, batch_id)))


@member_required()
@require_POST
def batch_cancel(request, batch_id: str):
    batch = services.cancel_batch(_batch_or_404(request, batch_id))
    messages.success(request, f"Batch {batch.pk} is {batch.get_status_display().lower()}: lines that finished are kept.")
    return redirect("console:batch", batch_id=batch.pk)


@member_required()
def file_download(request, file_id: str):
    # NOTE: a file's bytes are prompts and answers: only those who may call the API read them, as on /v1/files
    # (a viewer's session or key is refused there); a viewer still sees the batch's page and counts.
    if not request.membership.can(Role.MEMBER):
        raise PermissionDenied("Downloading a file needs the member role or higher.")
    file = File.objects.for_org(request.organization.pk).named(file_id).first()
    if file is None:
        raise Http404("No such file.")
    response = StreamingHttpResponse(storage.open_stream(file.s3_key), content_type="application/jsonl")
    response["Content-Length"] = str(file.bytes)
    response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=file.filename)
    return response
