"""`/v1/files` and `/v1/batches`: OpenAI's Files and Batch API, so the `openai` client works unchanged.

The gateway (`endpoints.gateway.app`) hands these paths to Django: they are bookkeeping and uploads,
not the inference hot path. Callers authenticate as on every `/v1` path (`endpoints.gateway.auth`: the
same keys, cache and refusals); answers and errors are in OpenAI's shape; another organisation's file
or batch is a 404, as one that does not exist. Uploads are multipart; Django's ASGI handler spools the body to a
temporary file (never whole in memory), then the file part goes to S3 as the body is parsed (`uploads`), refused
past `INFERPLANE_FILES_MAX_BYTES` as it streams in: one copy of an upload on the web pod's disk, never two.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from asgiref.sync import async_to_sync
from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt

from controlplane.text import storable
from endpoints.batches import idempotency, services, storage, uploads
from endpoints.batches.models import Batch, File
from endpoints.gateway import auth, errors
from endpoints.gateway.auth import Caller
from endpoints.gateway.ratelimit_headers import RateLimitReport

logger = logging.getLogger("inferplane.batches")

MAX_LIST = 100  # rows in one page of a list
MAX_FILES_LIMIT = 10_000  # the largest `limit` OpenAI's files list takes (its batches list takes 100)


def _error(exc: errors.OpenAIError) -> HttpResponse:
    response = HttpResponse(exc.body(), status=exc.status, content_type="application/json")
    for name, value in exc.headers.items():
        response[name] = value
    return response


def _not_found(kind: str, object_id: str) -> errors.OpenAIError:
    return errors.OpenAIError(404, f"No such {kind} object: {object_id}", param="id")


def _openai_view(handler):
    """Authenticates the caller and turns refusals into OpenAI's error shape."""

    @csrf_exempt
    def view(request, *args, **kwargs):
        report = RateLimitReport.unauthenticated()
        response = _answer(request, report, *args, **kwargs)
        # Every /v1 answer says what is left of the caller's limits (these calls themselves count nothing).
        for name, value in report.headers():
            response[name.decode()] = value.decode()
        return response

    def _answer(request, report: RateLimitReport, *args, **kwargs) -> HttpResponse:
        try:
            headers = {name.lower(): value for name, value in request.headers.items()}
            caller = async_to_sync(auth.authenticate)(headers)
            report.for_caller(caller)
            async_to_sync(report.read_counts)()
            return handler(request, caller, *args, **kwargs)
        except errors.OpenAIError as exc:
            return _error(exc)
        except services.Refused as exc:
            return _error(_refusal(exc))
        except (MultiPartParserError, TooManyFieldsSent, TooManyFilesSent, RequestDataTooBig) as exc:
            # NOTE: what Django's parser refuses in a body (a part's headers past its limit, a broken boundary, too
            # many parts) reached Django's 400 page, with no body at all, not OpenAI's shape.
            return _error(_unparsable_body(exc))
        except (*errors.OUTAGES, BotoCoreError, ClientError):
            logger.exception("files and batches: %s %s", request.method, request.path)
            return _error(errors.service_unavailable())

    return view


def _refusal(exc: services.Refused) -> errors.OpenAIError:
    """A service's refusal in OpenAI's shape. NOTE: a lasting one says `x-should-retry: false`: the OpenAI clients
    retry every 409 and 429 by themselves (twice by default, within seconds), and deleting an open batch's input
    (409 `file_in_use`) or creating a batch past the cap (429 `batch_limit_reached`) was sent three times, the
    client sleeping between, for the same refusal."""
    return errors.OpenAIError(exc.status, exc.message, param=exc.param, code=exc.code,
                              headers={"x-should-retry": "false"} if exc.lasting else None)


def _unparsable_body(exc: Exception) -> errors.OpenAIError:
    """The refusal of a body Django's multipart parser would not read (`exc`, its reason)."""
    if isinstance(exc, RequestDataTooBig):
        return errors.OpenAIError(413, f"The form fields are larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.")
    return errors.invalid_request(f"We could not parse the multipart form data of your request: {exc}")


def _method_not_allowed(request, *allowed: str) -> HttpResponse:
    return _error(errors.method_not_allowed(request.method, request.path, allowed))


def _query(request, name: str) -> str:
    """A query parameter ("" when absent), refused with a 400 naming it when PostgreSQL could not compare
    it (a NUL: `text.storable`)."""
    value = request.GET.get(name, "")
    if not storable(value):
        raise errors.invalid_request(f"{name} must not contain NUL characters.", param=name)
    return value


def _page(queryset, request, *, default_limit: int, max_limit: int = MAX_LIST, cursors=None) -> dict:
    """A cursor page as OpenAI lists it (`after` an id, newest first, or oldest first with `order=asc`): `limit` rows
    at most, and never more than `MAX_LIST` whatever `limit` (1 to `max_limit`, OpenAI's range) asks; `has_more` says
    more follow. `after` is looked up among `cursors` (default: `queryset`), so a row that left the list since it was
    read (a deleted file) still marks where its page ended.

    NOTE: the `after` of a file deleted since its page was read was taken for no cursor, and the list started over:
    a client deleting files as it listed them (the openai client's pages follow `last_id`) was given the first page
    again. And `files.list(limit=1000)`, within OpenAI's 1 to 10,000, was a 400."""
    try:
        limit = int(request.GET.get("limit", default_limit))
    except ValueError:
        raise errors.invalid_request("limit must be an integer.", param="limit") from None
    if not 1 <= limit <= max_limit:
        raise errors.invalid_request(f"limit must be between 1 and {max_limit}.", param="limit")
    limit = min(limit, MAX_LIST)
    ascending = request.GET.get("order") == "asc"
    queryset = queryset.order_by(*(("created_at", "id") if ascending else ("-created_at", "-id")))
    if after := _query(request, "after"):
        anchor = (queryset if cursors is None else cursors).filter(pk=after).first()
        if anchor is not None:
            if ascending:
                queryset = queryset.filter(created_at__gte=anchor.created_at).exclude(created_at=anchor.created_at, id__lte=anchor.id)
            else:
                queryset = queryset.filter(created_at__lte=anchor.created_at).exclude(created_at=anchor.created_at, id__gte=anchor.id)
    rows = list(queryset[: limit + 1])
    data = [row.as_openai() for row in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


@_openai_view
def unknown_url(request, caller: Caller):
    """Any other path under `/v1/files` or `/v1/batches` (`urls`)."""
    raise errors.unknown_url(request.method, request.path)


# --- files -----------------------------------------------------------------------------------

def refuse_upload_before_its_body(organization_id: int, declared: int, *,
                                  headers: Mapping[str, str] | None = None) -> None:
    """Refuse (`errors.OpenAIError`, as `_upload` would) an upload to `/v1/files` whose `headers` send an
    `Idempotency-Key` that is none (`idempotency.key_of`), or one its organisation's storage quota has no room for,
    from its declared size alone: the gateway asks before Django writes its body to the web pod's disk (a console
    form's upload sends no `headers`: its view takes no key)."""
    if headers is not None:
        idempotency.key_of(headers)
    try:
        services.refuse_upload_past_storage_quota(organization_id, uploads.counted_bytes(declared))
    except services.Refused as exc:
        raise _refusal(exc) from None


def _upload(request, caller: Caller) -> HttpResponse:
    declared = int(request.META.get("CONTENT_LENGTH") or 0)
    if declared > settings.FILES_MAX_BYTES + uploads.MULTIPART_OVERHEAD_BYTES:
        raise errors.OpenAIError(413, f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", param="file")
    claim = None
    if (key := idempotency.key_of(request.headers)) is not None:
        # NOTE: claimed before the body is parsed (an upload's digest is known only at its end): a retry while the
        # first streams to S3 is a 409 at once; one after it is replayed, its file read for its digest, never stored.
        started = idempotency.begin(caller, key, digest="")
        if isinstance(started, idempotency.Saved):
            return _replay_upload(request, started)
        claim = started
    with idempotency.held(claim):
        storing = uploads.StreamToStorage.handle(request, organization_id=caller.organization_id,
                                                 reserved=uploads.counted_bytes(declared))
        try:
            request.FILES  # noqa: B018 - parses the body, the file part going to S3 as it is read
            purpose = _upload_purpose(request, storing)
            expires_after = _upload_expiry(request)
            if claim is not None:
                claim.request_digest = _upload_digest(request, purpose, storing, expires_after)
            file = storing.finish(claim=claim, expires_after=expires_after)
        except BaseException:
            storing.abandon()
            raise
    return JsonResponse(file.as_openai())


def _upload_purpose(request, parsed: uploads.FileDigest) -> str:
    """The purpose of an upload whose body `parsed` read, refused unless it sent a file to store as a batch's input."""
    if parsed.digest is None:
        raise errors.invalid_request("Send the file as multipart form data, field 'file'.", param="file")
    purpose = request.POST.get("purpose", "")
    services.refuse_unknown_purpose(purpose)
    return purpose


def _upload_expiry(request):
    """OpenAI's `expires_after` of an upload, sent by its client as the form fields `expires_after[anchor]` and
    `expires_after[seconds]` (`services.file_expiry`)."""
    try:
        return services.file_expiry(request.POST.get("expires_after[anchor]"), request.POST.get("expires_after[seconds]"))
    except services.Refused as exc:
        raise _refusal(exc) from None


def _upload_digest(request, purpose: str, parsed: uploads.FileDigest, expires_after=None) -> str:
    """What an upload asks for, under its idempotency key: its file's bytes, purpose and `expires_after` (only when
    sent: a key an upload without one saved, the release before's too, matches as before).

    NOTE: the expiry was left out: the same bytes sent again under the key asking to expire in an hour were answered
    the first upload's file, kept for good."""
    if expires_after is None:
        return idempotency.request_digest(request.method, request.path, purpose, parsed.digest)
    return idempotency.request_digest(request.method, request.path, purpose, parsed.digest,
                                      str(int(expires_after.total_seconds())))


def _replay_upload(request, saved: idempotency.Saved) -> HttpResponse:
    """The saved answer of an upload sent again with its key, once its file is read (not stored) and found the same."""
    parsed = uploads.FileDigest.handle(request)
    request.FILES  # noqa: B018 - parses the body, the file part only hashed
    purpose = _upload_purpose(request, parsed)
    return _replayed(saved, _upload_digest(request, purpose, parsed, _upload_expiry(request)))


def _replayed(saved: idempotency.Saved, digest: str) -> HttpResponse:
    """The answer saved under a key, to a request that sent it again asking for the same (`digest`); else a 422."""
    status, body = saved.answer_for(digest)
    response = JsonResponse(body, status=status)
    response["Idempotent-Replayed"] = "true"
    return response


@_openai_view
def files(request, caller: Caller):
    if request.method == "POST":
        return _upload(request, caller)
    if not errors.answers_as_get(request.method):
        return _method_not_allowed(request, "GET", "POST")
    queryset = File.objects.for_org(caller.organization_id)
    if purpose := _query(request, "purpose"):
        queryset = queryset.filter(purpose=purpose)
    # NOTE: a deleted file's row stays (`services.delete_file`): still a cursor, never listed
    return JsonResponse(_page(queryset, request, default_limit=MAX_LIST, max_limit=MAX_FILES_LIMIT,
                              cursors=File.objects.filter(organization_id=caller.organization_id)))


def _file_of(caller: Caller, file_id: str) -> File:
    file = File.objects.for_org(caller.organization_id).named(file_id).first()
    if file is None:
        raise _not_found("File", file_id)
    return file


@_openai_view
def file_detail(request, caller: Caller, file_id: str):
    # NOTE: the method first, as every other /v1 route: a PUT was a 404 for a file id that did not exist and a 405
    # for one that did.
    if request.method != "DELETE" and not errors.answers_as_get(request.method):
        return _method_not_allowed(request, "GET", "DELETE")
    file = _file_of(caller, file_id)
    if request.method != "DELETE":
        return JsonResponse(file.as_openai())
    services.delete_file(file)
    return JsonResponse({"id": file.pk, "object": "file", "deleted": True})


@_openai_view
def file_content(request, caller: Caller, file_id: str):
    if not errors.answers_as_get(request.method):
        return _method_not_allowed(request, "GET")
    file = _file_of(caller, file_id)
    try:
        if request.method == "HEAD":
            # NOTE: HEAD answered 200 from the file's row while GET, its object gone from the bucket, was a 404: S3 is
            # asked (a HeadObject, its bytes not read) as GET would ask it, and answers as GET would.
            storage.head(file.s3_key)
            stream = None
        else:
            stream = storage.open_stream(file.s3_key)
    except storage.ObjectGone as gone:
        # NOTE: a file row whose object is not in the bucket was a 503 with `retry-after: 1`, and the openai client
        # retried it, and its caller after it, for ever: its bytes do not come back. S3 failing stays a 503, and so
        # does an object the fleet may not read (an IAM policy, a KMS key, the bucket's name: the operator's to mend,
        # its bytes still stored), which was a 404 telling the tenant they were gone.
        if not gone.missing:
            raise gone.__cause__ from None  # a `ClientError`: a 503 (`_openai_view`), logged
        logger.warning("file %s: its object %s is not in the bucket (or not readable)", file.pk, file.s3_key)
        raise errors.OpenAIError(404, f"File {file.pk} has no content: its bytes are no longer stored.",
                                 param="id", code="file_content_not_found") from None
    if stream is None:
        response = HttpResponse(content_type="application/octet-stream")
    else:
        response = StreamingHttpResponse(stream, content_type="application/octet-stream")
    response["Content-Length"] = str(file.bytes)
    response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=file.filename)
    return response


# --- batches ---------------------------------------------------------------------------------

@_openai_view
def batches(request, caller: Caller):
    if errors.answers_as_get(request.method):
        return JsonResponse(_page(Batch.objects.for_org(caller.organization_id), request, default_limit=20))
    if request.method != "POST":
        return _method_not_allowed(request, "GET", "POST")
    key = idempotency.key_of(request.headers)
    try:
        payload = json.loads(request.body or b"{}")
    except (ValueError, RecursionError):
        raise errors.invalid_request("We could not parse the JSON body of your request.") from None
    if not isinstance(payload, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(payload.get(name), str) or not payload[name]:
            raise errors.invalid_request(f"Missing required parameter: '{name}'.", param=name,
                                         code="missing_required_parameter")
    claim = None
    if key is not None:
        digest = idempotency.request_digest(request.method, request.path, request.body)
        started = idempotency.begin(caller, key, digest=digest)
        if isinstance(started, idempotency.Saved):
            return _replayed(started, digest)
        claim = started
    with idempotency.held(claim):
        batch = services.create_batch(organization_id=caller.organization_id, api_key_id=caller.api_key_id,
                                      user_id=caller.user_id, input_file_id=payload["input_file_id"],
                                      request_path=payload["endpoint"], completion_window=payload["completion_window"],
                                      metadata=payload.get("metadata"), claim=claim,
                                      output_expires_after=payload.get("output_expires_after"))
    return JsonResponse(batch.as_openai())


def _batch_of(caller: Caller, batch_id: str) -> Batch:
    batch = Batch.objects.for_org(caller.organization_id).named(batch_id).first()
    if batch is None:
        raise _not_found("Batch", batch_id)
    return batch


@_openai_view
def batch_detail(request, caller: Caller, batch_id: str):
    if not errors.answers_as_get(request.method):
        return _method_not_allowed(request, "GET")
    return JsonResponse(_batch_of(caller, batch_id).as_openai())


@_openai_view
def batch_cancel(request, caller: Caller, batch_id: str):
    """Cancel a batch: idempotent as it is (a batch cancelled again while `cancelling` is answered as it is now; one
    that has ended is a 409, `services.cancel_batch`), so an `Idempotency-Key` is checked but saves nothing."""
    if request.method != "POST":
        return _method_not_allowed(request, "POST")
    idempotency.key_of(request.headers)
    return JsonResponse(services.cancel_batch(_batch_of(caller, batch_id)).as_openai())
