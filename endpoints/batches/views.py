"""Console pages for batches: upload a JSONL file and start a batch, follow its progress (live), download
its output and error files, cancel it. They call the same services as `/v1/files` and `/v1/batches`."""

from __future__ import annotations

import secrets

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.shortcuts import redirect, render
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST, require_safe

from controlplane.accounts.console import member_required, page_organization_refusal
from controlplane.accounts.models import Role
from endpoints.batches import idempotency, services, storage, uploads
from endpoints.batches.models import BATCH_PATHS, Batch, BatchStatus, File
from endpoints.gateway import errors, upload_places
from endpoints.gateway.auth import Caller
from endpoints.models import EndpointEvent, EventKind

NUM_BATCHES_SHOWN = 50
# What a file sent through this form may weigh: its body goes through the public ingress, whose limit is 16 MiB
# (infra/k8s/base/ingress.yaml; tests/infra/test_network_isolation.py keeps the two in step), not the files
# ingress's. NOTE: the form said "up to 200 MB" (the Files API's limit), and nginx answered a larger file with its own
# HTML 413 page.
CONSOLE_FILE_MAX_BYTES = 15 * 1024 * 1024


def console_upload_max_body_bytes() -> int:
    """The largest body the batch form takes (the file, and its multipart framing): what the gateway cuts its uploads
    at, and refuses one declaring more (`Gateway._console_upload`)."""
    return min(settings.FILES_MAX_BYTES, CONSOLE_FILE_MAX_BYTES) + uploads.MULTIPART_OVERHEAD_BYTES


class _StoredFileField(forms.FileField):
    """The form's file: what `uploads.StreamToStorage` started storing as the body was parsed (a `File` row)."""

    def to_python(self, data):
        return data or None


class BatchForm(forms.Form):
    file = _StoredFileField(label="Requests (JSONL)", help_text="One request per line: custom_id, method, url, body.")
    endpoint = forms.ChoiceField(label="Endpoint path", choices=[(path, path) for path in BATCH_PATHS])
    # The form's one-time key (`new_batch_form`), its batch's `Idempotency-Key`: sent again, the form leads to the batch
    # it started. NOTE: a form sent twice (a double click, a resend after a timeout) started two batches, each run and
    # billed. Optional: a page rendered before it came still starts its batch.
    idempotency_key = forms.CharField(widget=forms.HiddenInput, required=False)

    def clean(self):
        cleaned = super().clean()
        if (key := cleaned.get("idempotency_key")) and not idempotency.is_key(key):
            raise forms.ValidationError("This form's key is not one the console gives: reload the page.")
        return cleaned


def new_batch_form() -> BatchForm:
    return BatchForm(initial={"idempotency_key": secrets.token_urlsafe(24)})


def _batch_or_404(request, batch_id: str) -> Batch:
    batch = Batch.objects.for_org(request.organization.pk).select_related("endpoint").named(batch_id).first()
    if batch is None:
        raise Http404("No such batch.")
    return batch


class _CsrfBeforeBody(CsrfViewMiddleware):
    """Django's CSRF check up to its token, which is in the body, not read yet: the Origin (or, over HTTPS with none,
    the Referer). It marks nothing done, so the whole check still runs once the body is read (`_create_batch`)."""

    def _check_token(self, request) -> None:
        return None

    def _accept(self, request) -> None:
        return None  # NOTE: Django's sets `csrf_processing_done`, and the token would then never be checked


@csrf_exempt  # NOTE: checked once the upload's handlers are installed (`_create_batch`), never before
@member_required(view_reads_form=True)  # the page's organisation, too (`_create_batch`)
def batch_list(request):
    form, refusal = new_batch_form(), None
    # NOTE: the action's page organisation is read before the body, its CSRF token in it: a page of another site
    # posting the form, naming one, had a message written into the member's session, and a redirect. Its origin first.
    if request.method == "POST" and (forged := _CsrfBeforeBody(lambda _: None).process_view(request, None, (), {})):
        return forged
    if request.method == "POST" and (stale := page_organization_refusal(request, in_query=True)) is not None:
        # NOTE: the form's action names the organisation its page was shown for: a stale tab's upload is refused
        # before its body is read (the gateway took no place for it, and dropped it). It was refused only once its
        # file had streamed to S3 under the organisation switched to, holding that organisation's upload place.
        return stale
    if request.method == "POST" and (refusal := upload_places.refusal_in(getattr(request, "scope", {}))):
        # The gateway gave the upload no place (`Gateway._console_upload`) and dropped its body: the form says why.
        form = _with_file_error(form, refusal.message)
    elif request.method == "POST":
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        storing = uploads.StreamToStorage.handle(request, organization_id=request.organization.pk,
                                                 reserved=uploads.counted_bytes(declared))
        try:
            created = _create_batch(request, storing)
        finally:
            storing.abandon()  # nothing once its file is stored
        if isinstance(created, HttpResponse):
            return created
        if isinstance(created, str):
            messages.success(request, f"Batch {created} created: its lines are being checked.")
            return redirect("console:batch", batch_id=created)
        form = created
    batches = Batch.objects.for_org(request.organization.pk).select_related("endpoint").order_by("-created_at")
    response = render(request, "batches/batch_list.html", {
        "batches": batches[:NUM_BATCHES_SHOWN], "form": form, "can_write": request.membership.can(Role.MEMBER),
        "max_mb": min(settings.FILES_MAX_BYTES, CONSOLE_FILE_MAX_BYTES) // (1024 * 1024),
        "api_max_mb": settings.FILES_MAX_BYTES // (1024 * 1024),
    }, status=refusal.status if refusal else 400 if form.errors else 200)
    for name, value in (refusal.headers if refusal else {}).items():
        response[name] = value  # a 429's Retry-After
    return response


def _with_file_error(form: BatchForm, message: str) -> BatchForm:
    """`form` with `message` as its file's error, bound or not.

    NOTE: a form refused before it was bound (or cleaned) has no `cleaned_data`, and `add_error` on it raised."""
    if not hasattr(form, "cleaned_data"):
        form.cleaned_data = {}
    form.add_error("file", message)
    return form


# What the form says when its key (`BatchForm.idempotency_key`) refuses it, by the refusal's code.
_KEY_REFUSALS = {
    "idempotency_key_in_use": "This form was sent already and its batch is still starting: it appears below in a "
                              "moment.",
    "idempotency_key_reused": "This form already started a batch, with another file or endpoint: reload the page to "
                              "start another.",
}


def _create_batch(request, storing: uploads.StreamToStorage) -> str | BatchForm | HttpResponse:
    """The id of the batch the form starts, its file streamed to S3 as the body is parsed (`storing`, as on
    `/v1/files`), or that it started already when sent again (its key, `BatchForm.idempotency_key`, as a creation's
    `Idempotency-Key`: this upload is then left unstored); or the form with its errors; or the CSRF check's refusal,
    or the page organisation's (`page_organization_refusal`).
    The caller abandons the upload unless it is stored.

    NOTE: the file went through Django's `TemporaryFileUploadHandler`, a second copy of the body's file on the web
    pod's disk beside the one Django's ASGI handler spools, then from there to S3. The CSRF check reads the form:
    the view is exempt from the middleware's, which ran before the handlers could be installed, and checks here."""
    # NOTE: a form refused before it is bound is shown again with a key of its own: it had none, and sent twice from
    # there started two batches (found by the review of the form's key).
    form = new_batch_form()
    try:
        request.FILES  # noqa: B018 - parses the body, the file part going to S3 as it is read
        refusal = CsrfViewMiddleware(lambda request: None).process_view(request, None, (), {})
        if refusal is not None:
            return refusal
        # NOTE: a form shown for another organisation than the session's now starts nothing; its file, streamed as
        # the body was parsed, is never finished (the caller abandons it)
        if (refusal := page_organization_refusal(request)) is not None:
            return refusal
        form = BatchForm(request.POST, {uploads.FILE_FIELD: storing.file} if storing.file else {})
        if not form.is_valid():
            return form
        claim = None
        if key := form.cleaned_data["idempotency_key"]:
            digest = idempotency.request_digest(request.method, request.path, form.cleaned_data["endpoint"],
                                                storing.digest)
            started = idempotency.begin(_form_caller(request), key, digest=digest)
            if isinstance(started, idempotency.Saved):
                return started.answer_for(digest)[1]["id"]
            claim = started
        with idempotency.held(claim):
            input_file = storing.finish()
            try:
                return services.create_batch(organization_id=request.organization.pk, api_key_id=None,
                                             user_id=request.user.pk, input_file_id=input_file.pk,
                                             request_path=form.cleaned_data["endpoint"], completion_window="24h",
                                             metadata=None, claim=claim).pk
            except services.Refused:
                # NOTE: the file was stored for this batch alone: kept, each refused try left a file and its S3 object
                # counted against the storage quota, listed nowhere in the console
                services.delete_file(input_file)
                raise
    except services.Refused as exc:
        if exc.param == "endpoint" and form.is_bound:
            form.add_error("endpoint", exc.message)  # the model's task: the endpoint chosen is what is wrong
            return form
        # NOTE: refused as the body was parsed (past the storage quota, or the size), the form was never bound, and
        # `add_error` on it raised (a 500).
        return _with_file_error(form, exc.message)
    except errors.OpenAIError as exc:  # refused by its key, once the form was cleaned
        if exc.code not in _KEY_REFUSALS:
            raise
        form.add_error(None, _KEY_REFUSALS[exc.code])
        return form


def _form_caller(request) -> Caller:
    """The session posting the batch form, as an idempotency key names its caller (`Caller.limit_subject`)."""
    return Caller(organization_id=request.organization.pk, api_key_id=None, user_id=request.user.pk, can_infer=False,
                  requests_per_minute=None, tokens_per_minute=None)


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
    batch = _batch_or_404(request, batch_id)
    try:
        batch = services.cancel_batch(batch)
    except services.Refused as exc:  # it ended (or is finalizing) since its page was shown
        messages.error(request, exc.message)
        return redirect("console:batch", batch_id=batch.pk)
    messages.success(request, f"Batch {batch.pk} is {batch.get_status_display().lower()}: lines that finished are kept.")
    return redirect("console:batch", batch_id=batch.pk)


@member_required()
@require_safe  # NOTE: a POST (any method) streamed the file, and was a 500 where S3 refused the read
def file_download(request, file_id: str):
    # NOTE: a file's bytes are prompts and answers: only those who may call the API read them, as on /v1/files
    # (a viewer's session or key is refused there); a viewer still sees the batch's page and counts.
    if not request.membership.can(Role.MEMBER):
        raise PermissionDenied("Downloading a file needs the member role or higher.")
    file = File.objects.for_org(request.organization.pk).named(file_id).first()
    if file is None:
        raise Http404("No such file.")
    try:
        stream = storage.open_stream(file.s3_key)
    except storage.ObjectGone as gone:  # NOTE: a 500 before; its bytes do not come back
        if not gone.missing:  # NOTE: not readable (an IAM policy, a KMS key): still stored, the operator's to mend
            raise gone.__cause__ from None
        raise Http404("This file's content is no longer stored.") from None
    response = StreamingHttpResponse(stream, content_type="application/jsonl")
    response["Content-Length"] = str(file.bytes)
    response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=file.filename)
    return response
