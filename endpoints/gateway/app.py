"""The gateway's ASGI application: `/v1/models`, `/v1/chat/completions`, `/v1/completions`,
`/v1/embeddings`, `/v1/responses` (its stored-response routes a 400: `responses`), `/metrics` (token only).

Everything else goes to Django, `/v1/files*` and `/v1/batches*` too (`endpoints.batches.api`). One request's life:

    authenticate → endpoint by `model` → admit (rate limits, reserve its largest cost, pick a
    READY replica: one Redis round trip) → hold while one cold-starts if none is READY → proxy,
    streaming unchanged → one usage row, whatever happened → settle the real cost.

A call whose usage row could not be recorded (the usage journal at its limit: `usage_recordable`) is refused first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from urllib.parse import parse_qs

from django.conf import settings

from billing.usage_writer import (
    SET_ASIDE_STOP_WAIT_S,
    replay_before_the_loop_ends,
    usage_recordable,
    writer_for_this_loop,
)
from controlplane import access_log, clock
from controlplane.access_log import REQUEST_ID_SCOPE_KEY, log_answer
from controlplane.accounts.console import PAGE_ORGANIZATION_FIELD
from controlplane.accounts.models import Role
from controlplane.hot_settings import hot
from controlplane.per_loop import PerLoop
from controlplane.worker_threads import in_worker_thread
from endpoints.gateway import (
    admission,
    anatomy,
    auth,
    cors,
    directory,
    drain,
    errors,
    fields,
    metrics,
    presence,
    responses,
    standing,
    upstream,
)
from endpoints.gateway.call import SHUTDOWN_FINISH_WAIT_S, ClientGone, InferenceCall, finish_pending
from endpoints.gateway.ratelimit_headers import RateLimitReport
from endpoints.gateway.request import MAX_BODY_BYTES, InferenceRequest, is_model_name, new_request_id
from endpoints.gateway.upload_places import MULTIPART_OVERHEAD_BYTES, REFUSAL_SCOPE_KEY, Place, UploadPlaces

logger = logging.getLogger("inferplane.gateway")

GC_YOUNG_THRESHOLD = 20_000
# At shutdown, how long the usage journal may take to reach the database before what is left is shipped to the bucket.
SHUTDOWN_REPLAY_S = 5.0
# A stop's steps after uvicorn's graceful wait (the server's own `--timeout-graceful-shutdown`, `drain`), as
# infra/k8s/base/web.yaml's grace period counts them: the cut calls' finishes, the journal's replay, its shipping. The
# shipping may run to their end counted from the signal (`drain.stop_budget_end`): what the drain did not use of its
# bound is left to it.
AFTER_GRACEFUL_S = SHUTDOWN_FINISH_WAIT_S + SHUTDOWN_REPLAY_S + SET_ASIDE_STOP_WAIT_S
# Served by Django (`endpoints.batches.api`): uploads and bookkeeping, not the inference hot path.
DJANGO_V1_PREFIXES = ("/v1/files", "/v1/batches")
FILES_PREFIX = "/v1/files"
# The largest body of the Files and Batch APIs but an upload (`_files_and_batches`): a batch's creation, its metadata
# at most 16 pairs of 64 + 512 characters.
DJANGO_V1_MAX_BODY_BYTES = 1024 * 1024
# The access log's status of a request whose client left before it was answered (as nginx logs one).
CLIENT_GONE_STATUS = 499
INFERENCE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding",
                   responses.PATH: responses.RESPONSES}


class Gateway:
    def __init__(self, fallback, *, refuse_upload: Callable[..., None] | None = None,
                 console_uploads: Mapping[str, int] | None = None, at_shutdown: Callable[[], object] | None = None):
        self.fallback = fallback
        # Blocking work the process must finish before it goes, run in a thread at the lifespan's shutdown, alongside
        # the journal's (given by the wiring: `accounts.mail_sender.send_backlog_before_stopping`, the reset mails
        # taken). NOTE: uvicorn raises the SIGTERM again after the shutdown (its default action kills the process):
        # `atexit` never runs on a pod's stop, so what waited for it was lost.
        self._at_shutdown = at_shutdown
        # (organisation, declared bytes[, headers=an upload to /v1/files's]) -> raises `errors.OpenAIError` for an
        # upload its storage quota has no room for, or whose `Idempotency-Key` is none
        # (`endpoints.batches.api.refuse_upload_before_its_body`, given by the wiring: the batches app imports the
        # gateway, never the other way round). Uses the ORM: run in a worker thread.
        self._refuse_upload = refuse_upload
        # NOTE: one client per event loop, closed as its loop ends (and by the lifespan's shutdown: uvicorn re-raises a
        # SIGTERM after it, and the loop's end never runs then): a connection belongs to the loop that opened it.
        # Before, one object served whichever loop asked (the process's `application` in one test's `asyncio.run`
        # after another's): a loop was handed the keep-alive connections of one already closed, and closing them at
        # the lifespan's shutdown raised "Event loop is closed".
        self._clients: PerLoop[upstream.UpstreamClient] = PerLoop(
            lambda: upstream.UpstreamClient(read_timeout_s=settings.GATEWAY_UPSTREAM_READ_TIMEOUT_S),
            close=upstream.UpstreamClient.close)
        self._folding: asyncio.Task | None = None  # `metrics.fold_every_second`, from startup on
        # The console's pages whose form posts a file (the batch form, `endpoints.batches.views.batch_list`), each with
        # the largest body it takes, given by the wiring: a `POST` to one takes an upload place as `/v1/files` does
        # (`_console_upload`).
        self._console_uploads = dict(console_uploads or {})
        self.upload_places = UploadPlaces()  # uploads this process is reading or storing now, of both kinds

    @property
    def client(self) -> upstream.UpstreamClient:
        # NOTE: created lazily inside the server's event loop, one per loop (the server runs one): the gateway's own
        # HTTP/1.1 client (`upstream`), leaner per request than aiohttp's (bench/results/gateway_profile.md, round 6).
        return self._clients.get()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] == "http":
            started = time.monotonic()
            try:
                return await self._http(scope, receive, send)
            except ClientGone:  # a body that stopped with its client's going, on any path: nobody to answer
                # NOTE: raised past here, uvicorn logs it with its traceback as an error: ~20 lines of ERROR a
                # connection, for anyone, without a key (a refused upload's body is read to its end, `_discard_body`).
                log_answer(scope, CLIENT_GONE_STATUS, started)
                return None
        return await self.fallback(scope, receive, send)

    async def _http(self, scope, receive, send):
        path = scope["path"]
        if path.startswith(DJANGO_V1_PREFIXES):
            headers = _headers_of(scope)
            if cors.is_preflight(scope["method"], headers):  # answered here: Django would want a key first
                return await _preflight(scope, receive, send, headers)
            # a browser's call, from any origin, may read the answer; every answer says it varies on `Origin` (`cors`)
            send = _with_cors(send, from_a_page=cors.ORIGIN_HEADER in headers)
            # NOTE: a stopping process waits for these too (`drain`): a 200 MB upload or a batch's output read
            # had only uvicorn's graceful wait after the drain, 10 s (the review of the drain).
            with drain.handling():
                if scope["method"] == "POST" and path.startswith(FILES_PREFIX):
                    return await self._upload(scope, receive, send)
                return await self._files_and_batches(scope, receive, send)
        if path.startswith("/v1/") or path == "/v1":
            with drain.handling():  # a stopping process waits for it (`drain`)
                return await self._handle(scope, receive, send)
        if path == "/metrics":
            return await self._metrics(scope, receive, send)
        if path in self._console_uploads and scope["method"] == "POST":
            with drain.handling():
                return await self._console_upload(scope, receive, send)
        return await self._to_django_in_memory(scope, receive, send)

    async def _to_django_in_memory(self, scope, receive, send) -> None:
        """Any other request for Django (the console, `/api/`, the agents' API, the admin, Stripe's webhooks, a page
        that does not exist): its body cut (413) past what Django keeps in memory (`_django_body_bytes`), or when it
        comes too slowly (408), as an upload's is; answered `{"detail": ...}`, as the management API answers.

        NOTE: only the Files and Batch APIs and the console's batch form were cut before Django read a body: anyone,
        with no session or key, could post as much as the ingress lets through to the log-in page or any path, and
        Django spooled it whole to the web pod's disk before any view ran, the connection held open (found by the
        review of console uploads). No other view takes a body past Django's `DATA_UPLOAD_MAX_MEMORY_SIZE`."""
        max_bytes = _django_body_bytes()
        if _declared_bytes(_headers_of(scope)) > max_bytes:
            # NOTE: answered at once, the body unread, the connection closed after: no page takes such a body, and
            # reading it to drop it was a wait its client set the pace of.
            return await _respond(send, 413, _detail(f"The request body is larger than {max_bytes} bytes."),
                                  headers={"connection": "close"})
        body = _BodyCut(receive, max_bytes, idle_s=settings.FILES_UPLOAD_IDLE_S,
                        min_bytes_per_s=settings.FILES_UPLOAD_MIN_BYTES_PER_S, what="request body")
        await self.fallback(scope, body.receive, send)
        if body.cut is not None:  # Django took it for a client gone and answered nothing
            await _respond(send, body.cut.status, _detail(body.cut.message), headers={"connection": "close"})

    async def _upload(self, scope, receive, send) -> None:
        """An upload to `/v1/files`, handed to Django once `_upload_may_start` lets it, counted until Django answers;
        its body cut at `FILES_MAX_BYTES` plus the multipart overhead (`MULTIPART_OVERHEAD_BYTES`) whatever it declared (a chunked one declares nothing), with a 413, and when
        it comes too slowly (`_BodyCut`), with a 408."""
        request_id = new_request_id()
        place = await self._upload_may_start(scope, receive, send, request_id)
        if place is None:
            return
        try:
            max_bytes = settings.FILES_MAX_BYTES + MULTIPART_OVERHEAD_BYTES  # the view holds the file to the limit
            # NOTE: its 413 states the file's limit, as every other refusal does: the overhead is the body's allowance
            await self._to_django(scope, receive, send, max_bytes, stated_bytes=settings.FILES_MAX_BYTES,
                                  place=place, request_id=request_id)  # endpoints.batches.api
        finally:
            # Django has closed the body's temporary file: its bytes are off the disk.
            self.upload_places.give_back(place)

    async def _console_upload(self, scope, receive, send) -> None:
        """A console form that posts a file (`console_uploads`): handed to Django once its session's organisation
        has taken an upload place (`UploadPlaces.take`), given back once Django has answered; its body cut as an
        upload's to `/v1/files` is (`_to_django`), past the form's own limit. Otherwise its body is dropped and Django
        answers a request without one: the refusal (a body declared past the form's limit or past what the
        organisation's storage quota has left, no place free, or the session not checked) in its scope
        (`REFUSAL_SCOPE_KEY`), which the form shows; or, for a session that may not post the form (none, a viewer's),
        what it answers any such.

        NOTE: console uploads took no place: through the public ingress a tenant could run any number of them at once,
        each up to 16 MiB spooled on the web pod's disk before the view runs, beside its uploads to `/v1/files`. And
        their bodies were cut only at the Files API's limit, the quota asked only by the view: a form upload past
        the console's limit, or one its organisation had no room for, was spooled whole first."""
        max_bytes = self._console_uploads[scope["path"]]
        place, refusal = None, None  # the session's organisation's place, once it holds one
        try:
            caller = await auth.caller_from_console_form(_headers_of(scope))
            # NOTE: a form shown for another organisation (a stale tab, its action's `page_organization`) takes no
            # place: its view refuses it (`page_organization_refusal`); it held the organisation switched to's place,
            # its body spooled and streamed to S3, until then.
            if caller is not None and caller.role != Role.VIEWER and not _shown_for_another(scope, caller):
                declared_bytes = _declared_bytes(_headers_of(scope))
                if declared_bytes > max_bytes:
                    raise errors.OpenAIError(413, f"The file is larger than {_in_mb(max_bytes)} MB, the most the "
                                                  "console uploads: send a larger one with the Files API.", param="file")
                if self._refuse_upload is not None:
                    await in_worker_thread(self._refuse_upload)(caller.organization_id, declared_bytes)
                place = await self.upload_places.take(caller.organization_id)
        except errors.OpenAIError as exc:
            refusal = exc
        except Exception as exc:
            if not errors.is_outage(exc):
                raise
            errors.log_outage(logger, exc, "console upload to %s: %r", scope["path"], exc)
            refusal = errors.service_unavailable()
        if place is None:
            await _discard_body(receive, scope)
            return await self.fallback(_without_body(scope, refusal), _after_an_empty_body(receive),
                                       _adding_headers(send, _CONNECTION_CLOSE) if _closing(scope) else send)
        try:
            await self._to_django(scope, receive, send, max_bytes, place=place)  # endpoints.batches.views
        finally:
            self.upload_places.give_back(place)

    async def _to_django(self, scope, receive, send, max_bytes: int, *, what: str = "file",
                         stated_bytes: int | None = None, place: Place | None = None, request_id: str = "") -> None:
        """Hand a request of the Files or Batch API to Django, its body cut past `max_bytes` (413, stating
        `stated_bytes` if given) or when it comes too slowly (408, `_BodyCut`); the upload's `place`, if any, marked answered as the answer's last byte goes
        (`UploadPlaces.take`); its answer named `request_id`, if any, as every other `/v1` answer is (`x-request-id`)."""
        if request_id:
            send = _naming_request(send, request_id)
            scope = scope | {REQUEST_ID_SCOPE_KEY: request_id}  # its access line names it too (`AccessLog`)
        if place is not None:
            send = self._marking_answered(send, place)
        body = _BodyCut(receive, max_bytes, idle_s=settings.FILES_UPLOAD_IDLE_S,
                        min_bytes_per_s=settings.FILES_UPLOAD_MIN_BYTES_PER_S, what=what, stated_bytes=stated_bytes)
        await self.fallback(scope, body.receive, send)
        if body.cut is not None:  # Django took it for a client gone and answered nothing
            # NOTE: the connection closes after the answer: a dripping client's body is not read on to its end.
            await _respond(send, body.cut.status, body.cut.body(), headers={"connection": "close"},
                           raw_headers=RateLimitReport.unauthenticated().headers())

    def _marking_answered(self, send, place: Place):
        async def sending(message):
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.upload_places.answered(place)  # before it goes: its client may send its next upload at once
            await send(message)

        return sending

    async def _files_and_batches(self, scope, receive, send) -> None:
        """Every other request of the Files and Batch APIs (`endpoints.batches.api`): handed to Django once its caller
        is authenticated, with its body cut at `DJANGO_V1_MAX_BODY_BYTES` (the largest is a batch's creation, a few
        KiB of JSON); otherwise answered here, as an upload refused (`_refuse`).

        NOTE: Django writes a whole body to a temporary file before any view runs, and only an upload (`POST
        /v1/files`) was checked here: a `PUT` or `PATCH` to `/v1/files` (or a body sent to any of these paths) without
        a key had Django spool as much as the ingress lets through (200 MiB) to the web pod's disk, each connection
        then held open (a review's attack: seven such filled the `/tmp` volume)."""
        started, request_id = time.monotonic(), new_request_id()
        headers = _headers_of(scope)
        try:
            await auth.authenticate(headers, source=auth.source_of(scope))
            if _declared_bytes(headers) > DJANGO_V1_MAX_BODY_BYTES:
                raise errors.OpenAIError(413, f"The request body is larger than {DJANGO_V1_MAX_BODY_BYTES} bytes.")
        except errors.OpenAIError as exc:
            return await _refuse(scope, receive, send, exc, started, request_id)
        except Exception as exc:
            if not errors.is_outage(exc):
                raise
            errors.log_outage(logger, exc, "gateway %s %s: %r", scope["method"], request_id, exc)
            return await _refuse(scope, receive, send, errors.service_unavailable(), started, request_id)
        await self._to_django(scope, receive, send, DJANGO_V1_MAX_BODY_BYTES, what="request body", request_id=request_id)

    async def _upload_may_start(self, scope, receive, send, request_id: str) -> Place | None:
        """The place of an upload to `/v1/files` that may go on to Django: its caller's key is valid, its
        declared size within `FILES_MAX_BYTES` and what its organisation's storage quota has left, its
        `Idempotency-Key` if any one the view would take (`refuse_upload`),
        and this process reads fewer than `FILES_UPLOADS_PER_PROCESS` uploads, the last place kept for an organisation
        that reads none (`UploadPlaces.take`; taken here: the caller, `_upload`, gives it back);
        otherwise None, answered here (OpenAI's shape), its body dropped unread or read and dropped.

        NOTE: Django reads a whole body (to a temporary file past 2.5 MB) before any view runs: anyone without a key
        could have it write up to the upload limit (200 MiB) to the web pod's disk per request, and any key as many
        uploads at once as it liked, past the `/tmp` volume's size: the pod was evicted, every tenant's calls on it
        cut. At most `FILES_UPLOADS_PER_PROCESS` bodies per process are on the disk at once
        (tests/infra/test_manifests.py holds the volume to it). NOTE: a bad `Idempotency-Key` too was refused only
        by the view, once Django had spooled the whole body."""
        started = time.monotonic()
        headers = _headers_of(scope)
        try:
            caller = await auth.authenticate(headers, source=auth.source_of(scope))
            declared_bytes = _declared_bytes(headers)
            if declared_bytes > settings.FILES_MAX_BYTES + MULTIPART_OVERHEAD_BYTES:  # the view holds the file to the limit
                raise errors.OpenAIError(413, f"The file is larger than {settings.FILES_MAX_BYTES} bytes.", param="file")
            if self._refuse_upload is not None:
                await in_worker_thread(self._refuse_upload)(caller.organization_id, declared_bytes, headers=headers)
            return await self.upload_places.take(caller.organization_id)
        except errors.OpenAIError as exc:
            refusal = exc
        except Exception as exc:
            if not errors.is_outage(exc):
                raise
            errors.log_outage(logger, exc, "gateway upload %s: %r", request_id, exc)
            refusal = errors.service_unavailable()
        await _refuse(scope, receive, send, refusal, started, request_id)
        return None

    async def _metrics(self, scope, receive, send):
        started = time.monotonic()
        access = metrics.access(scope)
        if access is metrics.Access.OFF:
            # The same 404 as any unknown path: nothing tells that metrics exist.
            return await self.fallback(scope, receive, send)
        if access is metrics.Access.DENIED:
            await _respond(send, 401, b"", content_type="text/plain", headers={"www-authenticate": "Bearer"})
            return log_answer(scope, 401, started)
        await in_worker_thread(metrics.refresh_fleet_gauges)()
        await _respond(send, 200, metrics.render(), content_type="text/plain; version=0.0.4")
        log_answer(scope, 200, started)

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                access_log.prepare()  # the URL conf, read now rather than by the first request logged
                _freeze_startup_objects()
                drain.install(after_graceful_s=AFTER_GRACEFUL_S)  # the first SIGTERM drains the calls in flight before the server hears it
                await presence.start(web=True)
                self._folding = asyncio.ensure_future(metrics.fold_every_second())
                writer_for_this_loop().replay_soon()  # usage a previous gateway left in the journal
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                at_shutdown = (asyncio.ensure_future(in_worker_thread(self._at_shutdown)())
                               if self._at_shutdown is not None else None)
                await finish_pending()  # calls cut at the graceful deadline still write their usage
                # NOTE: what the database would not take is shipped to the files bucket if it is still down: the pod,
                # and the journal on its volume, may go before it is back (`billing.journal_shipping`).
                ship_until = drain.stop_budget_end(
                    AFTER_GRACEFUL_S, at_least=time.monotonic() + SHUTDOWN_REPLAY_S + SET_ASIDE_STOP_WAIT_S)
                await replay_before_the_loop_ends(SHUTDOWN_REPLAY_S, process_stops=True, ship_until=ship_until)
                if self._folding is not None:
                    self._folding.cancel()
                metrics.fold()  # the last counts, before the process goes
                client = self._clients.peek()
                if client is not None:
                    await client.close()
                if at_shutdown is not None:
                    await at_shutdown
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _handle(self, scope, receive, send):
        started = time.monotonic()
        request_id = new_request_id()
        headers = _headers_of(scope)
        path, method = scope["path"], scope["method"]
        # NOTE: what a call without `Origin` (every server-side client) pays for CORS (issue #20): one dict lookup, and
        # `Vary: Origin` added to its answer's headers
        from_a_page = cors.ORIGIN_HEADER in headers  # a browser's call, from any origin: it may read the answer (`cors`)
        if from_a_page and cors.is_preflight(method, headers):
            return await _preflight(scope, receive, send, headers)
        # NOTE: an inference call's own answer takes CORS's headers in the headers it starts with (`cors_headers`), not
        # through this wrapper: a stream passes every chunk to `send`, and the wrapper cost each one a call
        answers = send
        send = _with_cors(send, from_a_page=from_a_page)
        ratelimit = RateLimitReport()  # every answer's x-ratelimit-* headers, filled in as the request goes
        try:
            if path == "/v1/models":
                if not errors.answers_as_get(method):
                    raise await _unread(receive, scope, errors.method_not_allowed(method, path, ("GET",)))
                await self._models(headers, send, request_id, ratelimit, auth.source_of(scope))
                return log_answer(scope, 200, started, request_id)
            if path.startswith(MODELS_PREFIX):
                if not errors.answers_as_get(method):
                    raise await _unread(receive, scope, errors.method_not_allowed(method, path, ("GET",)))
                await self._model(headers, send, request_id, ratelimit, path.removeprefix(MODELS_PREFIX),
                                  auth.source_of(scope))
                return log_answer(scope, 200, started, request_id)
            kind = INFERENCE_PATHS.get(path)
            if kind is None:
                if path.startswith(responses.STORED_PREFIX):
                    raise await _unread(receive, scope, responses.refuse_stored(method, path))
                raise await _unread(receive, scope, errors.unknown_url(method, path))
            if method != "POST":
                raise await _unread(receive, scope, errors.method_not_allowed(method, path, ("POST",)))
            if drain.draining():
                await _discard_body(receive, scope)
                raise errors.server_stopping()
            # NOTE: a flag, no I/O: its row could only go to a journal already at its limit. Calls admitted before
            # still write theirs (into the journal's headroom); this one is never proxied.
            if not usage_recordable():
                await _discard_body(receive, scope)
                raise errors.usage_unrecordable()
            try:
                caller = await auth.authenticate(headers, source=auth.source_of(scope))
            except Exception:
                await _discard_body(receive, scope)
                raise
            body = await _read_body(receive)
            ratelimit.for_caller(caller)
            inference = InferenceRequest.parse(body, kind=kind, path=path,
                                               wait_for_capacity=standing.wants_to_wait(headers),
                                               max_priority_boost=caller.max_priority_boost,
                                               progress=anatomy.wants_progress(headers))
            endpoint, adapter = await admission.resolve_model(caller=caller, model=inference.model, report=ratelimit)
            if adapter is not None:
                inference = dataclasses.replace(inference, engine_model=adapter.name)
            call = InferenceCall(
                request_id=request_id, request=inference, caller=caller, endpoint=endpoint, client=self.client,
                receive=receive, send=answers, started_at=clock.redis_datetime(), ratelimit=ratelimit, adapter=adapter,
                cors_headers=cors.answer_headers((), from_a_page=from_a_page),
            )
            await call.run()
        except ClientGone:  # its body stopped with the client's going: nobody to answer
            # NOTE: it was a CancelledError, which uvicorn logs with its traceback as an error: a client could write
            # ~20 lines of ERROR per call it left mid-body (found by the gateway's soak).
            log_answer(scope, CLIENT_GONE_STATUS, started, request_id)
        except errors.OpenAIError as exc:
            await ratelimit.read_counts()
            await _respond(send, exc.status, exc.body(), headers=exc.headers | {"x-request-id": request_id},
                           raw_headers=_ratelimit_headers(ratelimit) + _closing(scope))
            log_answer(scope, exc.status, started, request_id)
        except Exception as exc:  # noqa: BLE001 - never leak a traceback to a client; log it
            if errors.is_outage(exc):
                errors.log_outage(logger, exc, "gateway request %s: %r", request_id, exc)
                failure = errors.service_unavailable()
                await _respond(send, failure.status, failure.body(), headers=failure.headers | {"x-request-id": request_id},
                               raw_headers=_ratelimit_headers(ratelimit) + _closing(scope))
                log_answer(scope, failure.status, started, request_id)
                return
            logger.exception("gateway request %s failed", request_id)
            failure = errors.OpenAIError(500, "The server had an error processing your request.", type="server_error")
            await _respond(send, 500, failure.body(), headers={"x-request-id": request_id},
                           raw_headers=_ratelimit_headers(ratelimit))
            log_answer(scope, 500, started, request_id)

    async def _models(self, headers, send, request_id, ratelimit: RateLimitReport, source: str | None):
        caller = await auth.authenticate(headers, source=source)
        ratelimit.for_caller(caller)
        models = await directory.list_endpoints(caller.organization_id)
        data = []
        for endpoint in models:
            data.append(_model_object(endpoint))
            for adapter in (await directory.endpoint_adapters(endpoint.id)).values():
                data.append(_model_object(endpoint) | {"id": f"{endpoint.name}:{adapter.name}", "parent": endpoint.name})
        await ratelimit.read_counts()
        await _respond(send, 200, json.dumps({"object": "list", "data": data}).encode(), headers={"x-request-id": request_id},
                       raw_headers=ratelimit.headers())

    async def _model(self, headers, send, request_id, ratelimit: RateLimitReport, name: str, source: str | None):
        """`GET /v1/models/{id}` (`client.models.retrieve`): one of the caller's organisation's endpoints."""
        caller = await auth.authenticate(headers, source=source)
        ratelimit.for_caller(caller)
        if not name or not is_model_name(name):  # never looked up (`parse_payload` checks a body's `model` so)
            raise errors.model_not_found(fields.printable(name))
        endpoint, adapter = await admission.resolve_model(caller=caller, model=name, report=ratelimit)
        model = _model_object(endpoint)
        if adapter is not None:
            model |= {"id": f"{endpoint.name}:{adapter.name}", "parent": endpoint.name}
        await ratelimit.read_counts()
        await _respond(send, 200, json.dumps(model).encode(), headers={"x-request-id": request_id},
                       raw_headers=ratelimit.headers())


MODELS_PREFIX = "/v1/models/"


def _ratelimit_headers(ratelimit: RateLimitReport) -> list[tuple[bytes, bytes]]:
    """An answer to no known caller (a 401, an unknown URL) says the platform's default limits."""
    return (ratelimit if ratelimit.window is not None else RateLimitReport.unauthenticated()).headers()


def _model_object(endpoint: directory.EndpointInfo) -> dict:
    """An endpoint as OpenAI's model object."""
    return {"id": endpoint.name, "object": "model", "created": int(endpoint.created_at), "owned_by": "inferplane"}


def _freeze_startup_objects() -> None:
    """Keep the objects of startup (Django, its apps, the modules: over a hundred thousand) out of
    garbage collection. A full collection walks every tracked object; under load one ran every
    second or two, and the gateway's p99 at concurrency 16 fell from ~460 ms to ~100 ms without
    them (bench/bench_gateway.py). What requests allocate is still collected."""
    gc.collect()
    gc.freeze()
    # NOTE: a request allocates a few thousand objects, nearly all freed by reference counting; at the
    # default threshold (700) a young-generation collection ran about once per request.
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _headers_of(scope) -> dict[str, str]:
    return {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}


async def _read_body(receive) -> bytes:
    """An authenticated caller's body, whole: cut past `MAX_BODY_BYTES` (413), or when it comes too slowly (408
    `upload_too_slow`), as an upload's is (`_BodyCut`); the connection closes after either answer.

    NOTE: it had no deadline: a body that stopped coming mid-way (its client stalled, or gone without a FIN) held its
    connection, its request's task and a place the drain waits for, for ever: 50 such kept 50 tasks and sockets open
    in a soak (found by the gateway's soak)."""
    return await _BodyCut(receive, MAX_BODY_BYTES, idle_s=hot.FILES_UPLOAD_IDLE_S,
                          min_bytes_per_s=hot.FILES_UPLOAD_MIN_BYTES_PER_S, what="request body").whole()


class _BodyCut:
    """`receive` for Django, that ends a body (as if its client had gone: `http.disconnect`) past `max_bytes`, or
    when its next message has not come by `_deadline`: none for `idle_s`, or fewer than `min_bytes_per_s` a second on
    average after the first `idle_s`. `cut` is then the error to answer with (413, or 408). Django spools a body whole
    before any view runs, and never stops one that declared no length, or one that comes a byte at a time.
    `stated_bytes`: the limit the 413 states, where the body's bound allows more than its limit (an upload's file, its
    multipart overhead on top); `max_bytes` otherwise.

    NOTE: a body cut here never reached S3: Django parses a body, its file going to S3, only once it has it whole. Once
    the body has ended, what comes (Django waits for the client's going as it answers) is passed on untimed."""

    def __init__(self, receive, max_bytes: int, *, idle_s: float, min_bytes_per_s: int, what: str = "file",
                 stated_bytes: int | None = None):
        self._receive, self._max_bytes, self._what = receive, max_bytes, what
        self._stated_bytes = max_bytes if stated_bytes is None else stated_bytes
        self._param = "file" if what == "file" else None
        self._idle_s, self._min_bytes_per_s = idle_s, min_bytes_per_s
        self._started = time.monotonic()
        self._ended = False
        self.num_bytes = 0
        self.cut: errors.OpenAIError | None = None

    def _deadline(self, now: float) -> float:
        return min(now + self._idle_s, self._started + self._idle_s + self.num_bytes / self._min_bytes_per_s)

    def _too_slow(self) -> errors.OpenAIError:
        return errors.OpenAIError(
            408, f"The {self._what} came too slowly: a body must come at {self._min_bytes_per_s} bytes a second or "
            f"more, with no pause of {self._idle_s:g} s. Send it again.", param=self._param, code="upload_too_slow",
            headers={"connection": "close"})

    def _too_large(self) -> errors.OpenAIError:
        return errors.OpenAIError(413, f"The {self._what} is larger than {self._stated_bytes} bytes.", param=self._param,
                                  headers={"connection": "close"})

    async def receive(self):
        if self.cut is not None:
            return {"type": "http.disconnect"}
        if self._ended:
            return await self._receive()
        now = time.monotonic()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self._deadline(now) - now))
        except TimeoutError:
            self.cut = self._too_slow()
            return {"type": "http.disconnect"}
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self._max_bytes:
                self.cut = self._too_large()
                return {"type": "http.disconnect"}
            self._ended = not message.get("more_body")
        return message

    async def whole(self, *, keep: bool = True) -> bytes:
        """The body whole (or none of it, not `keep`), its cut raised (`ClientGone` for a client gone): what the gateway
        reads itself, on every
        call's warm path, under one timer moved on at each message (`wait_for` per message runs a task each: ~5.5 µs
        against ~4 for the timer, timed alone)."""
        loop = asyncio.get_running_loop()
        chunks = []
        try:
            async with asyncio.timeout(self._idle_s) as timer:  # the first message's deadline (`_deadline`)
                while True:
                    message = await self._receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone()
                    chunk = message.get("body", b"")
                    self.num_bytes += len(chunk)
                    if self.num_bytes > self._max_bytes:
                        raise self._too_large()
                    if keep:
                        chunks.append(chunk)
                    if not message.get("more_body"):
                        return b"".join(chunks)
                    now = time.monotonic()
                    timer.reschedule(loop.time() + max(0.0, self._deadline(now) - now))
        except TimeoutError:
            raise self._too_slow() from None


def _django_body_bytes() -> int:
    """The largest body Django keeps in memory (its ASGI handler spools one past `FILE_UPLOAD_MAX_MEMORY_SIZE` to a
    temporary file) and lets a view read (`DATA_UPLOAD_MAX_MEMORY_SIZE`): 2.5 MiB by default."""
    return min(settings.FILE_UPLOAD_MAX_MEMORY_SIZE, settings.DATA_UPLOAD_MAX_MEMORY_SIZE or sys.maxsize)


def _in_mb(num_bytes: int) -> int:
    return num_bytes // (1024 * 1024)


def _detail(message: str) -> bytes:
    return json.dumps({"detail": message}).encode()


def _declared_bytes(headers: dict[str, str]) -> int:
    """The body's declared length (0 when it declares none: chunked, cut by `_BodyCut`)."""
    declared = headers.get("content-length", "")
    return int(declared) if declared.isascii() and declared.isdigit() else 0


async def _refuse(scope, receive, send, refusal: errors.OpenAIError, started: float, request_id: str) -> None:
    """Answer a Files or Batch API request here, in OpenAI's shape, its body dropped unread or read and dropped."""
    await _discard_body(receive, scope)  # at most `MAX_BODY_BYTES` of it: past that the connection closes
    await _respond(send, refusal.status, refusal.body(), headers=refusal.headers | {"x-request-id": request_id},
                   raw_headers=RateLimitReport.unauthenticated().headers() + _closing(scope))
    log_answer(scope, refusal.status, started, request_id)


async def _preflight(scope, receive, send, headers: dict[str, str]) -> None:
    """A browser's CORS preflight of a `/v1` call, answered 204 from its path and headers alone (`cors`): no key
    lookup, no Redis, no database. NOTE: it was a 405 (the path takes no `OPTIONS`): every browser client failed it."""
    started = time.monotonic()
    await _discard_body(receive, scope)  # a preflight sends none; one that does is read no further than a refusal's
    # NOTE: no `content-type` or `content-length`: a 204 has no content (RFC 9110, 8.6)
    await send({"type": "http.response.start", "status": 204,
                "headers": cors.preflight_headers(scope["path"], headers) + _closing(scope)})
    await send({"type": "http.response.body", "body": b""})
    log_answer(scope, 204, started)


def _naming_request(send, request_id: str):
    """`send` whose answer carries `x-request-id` (what the openai client reads as `_request_id`).

    NOTE: the Files and Batch APIs' answers, Django's, carried none: only the gateway's own refusals of them did."""
    return _adding_headers(send, [(b"x-request-id", request_id.encode())])


def _with_cors(send, *, from_a_page: bool):
    """`send` of a `/v1` answer, whose headers say what CORS adds (`cors.answer_headers`): `Vary: Origin` on every
    answer, the CORS headers on one to a call that sent `Origin` (`from_a_page`)."""
    async def sending(message):
        if message["type"] == "http.response.start":
            message = message | {"headers": cors.answer_headers(message.get("headers", ()), from_a_page=from_a_page)}
        await send(message)

    return sending


def _adding_headers(send, headers: list[tuple[bytes, bytes]]):
    """`send` whose answer carries `headers` too."""
    async def sending(message):
        if message["type"] == "http.response.start":
            message = message | {"headers": [*message.get("headers", ()), *headers]}
        await send(message)

    return sending


def _shown_for_another(scope, caller: auth.Caller) -> bool:
    """Whether the console form posted in `scope` names, in its query string, another organisation than `caller`'s.

    NOTE: read as Django's `request.GET` reads it (`page_organization_refusal`), a blank value kept: one named empty
    (`?page_organization=`) is refused by the view, and took the organisation's place, its body spooled, until then."""
    shown_for = parse_qs(scope.get("query_string", b"").decode("latin-1"),
                         keep_blank_values=True).get(PAGE_ORGANIZATION_FIELD)
    return shown_for is not None and shown_for[-1] != str(caller.organization_id)


def _without_body(scope, refusal: errors.OpenAIError | None) -> dict:
    """`scope` of a request whose body is dropped (`_after_an_empty_body`), with the refusal of its upload if any."""
    headers = [(name, value) for name, value in scope["headers"]
               if name not in (b"content-length", b"transfer-encoding")]
    scope = scope | {"headers": [*headers, (b"content-length", b"0")]}
    return scope if refusal is None else scope | {REFUSAL_SCOPE_KEY: refusal}


def _after_an_empty_body(receive):
    """`receive` for Django, of an empty body, then of the client's going alone: what is left of a body that
    `_discard_body` stopped reading is dropped."""
    sent = False

    async def receive_without_body():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message

    return receive_without_body


# Set in a request's scope by `_discard_body` when it stopped reading the body: its answer closes the connection.
BODY_CUT_SCOPE_KEY = "inferplane.body_cut"
_CONNECTION_CLOSE = [(b"connection", b"close")]


def _closing(scope) -> list[tuple[bytes, bytes]]:
    """`connection: close`, for the answer of a request whose body `_discard_body` cut (none otherwise): uvicorn
    closes the connection once that answer is sent."""
    return _CONNECTION_CLOSE if scope.get(BODY_CUT_SCOPE_KEY) else []


async def _unread(receive, scope, refusal: errors.OpenAIError) -> errors.OpenAIError:
    """`refusal`, once the body it refuses unread is discarded (`_discard_body`). NOTE: a 405, a 404 or a stored
    response's 400 was sent with the body unread: uvicorn read on while the caller dripped it, and the connection
    stayed for as long as the caller liked, with no key needed."""
    await _discard_body(receive, scope)
    return refusal


async def _discard_body(receive, scope) -> None:
    """Read a refused caller's body to its end keeping none of it, so that its client reads the answer rather than
    a connection reset mid-upload; past `MAX_BODY_BYTES` the answer goes and the server closes the connection.

    NOTE: the key is checked before the body is kept: a caller without one held up to 8 MiB per connection. A body
    that pauses for `FILES_UPLOAD_IDLE_S`, or comes slower than an upload may (`_BodyCut`), is read no further (the
    answer goes, the connection closes): a client that sent a few bytes and then nothing held its connection for as
    long as it liked, and one that dripped a byte every 29 s did still (found by the review of the gateway's soak).
    A cut is marked in `scope` (`BODY_CUT_SCOPE_KEY`): its answer says `connection: close`, and the server closes
    the connection once it is sent. NOTE: without it, uvicorn kept reading the rest of the body (it drops it) while
    the client went on dripping, each byte putting off its keep-alive timeout: the connection stayed for as long as
    the client liked, after the answer."""
    body = _BodyCut(receive, MAX_BODY_BYTES, idle_s=settings.FILES_UPLOAD_IDLE_S,
                    min_bytes_per_s=settings.FILES_UPLOAD_MIN_BYTES_PER_S, what="request body")
    try:
        await body.whole(keep=False)
    except errors.OpenAIError:  # cut (too slow, too large): the answer goes, the connection closes
        scope[BODY_CUT_SCOPE_KEY] = True


async def _respond(send, status: int, body: bytes, *, content_type: str = "application/json", headers: dict | None = None,
                   raw_headers: list[tuple[bytes, bytes]] = ()):
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    raw += raw_headers
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
