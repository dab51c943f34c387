"""The agent API (`/agent/v1/`): JSON in and out, shaped by `gpu_agent.protocol`.

Agents authenticate with a join token once (in the register body) and with
their node secret afterwards (`Authorization: Bearer nd_…`).
"""

from __future__ import annotations

import json

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from controlplane import pubsub
from controlplane.credential_lookups import LookupsBusy
from endpoints.fleet import services
from endpoints.nodes.models import ServiceAddressesUnresolved
from endpoints.nodes.notify import node_channel
from gpu_agent import protocol


def _error(status: int, message: str, *, code: str = "") -> JsonResponse:
    return JsonResponse({"error": {"message": message} | ({"code": code} if code else {})}, status=status)


def _busy(message: str = "too many credentials are being checked at once") -> JsonResponse:
    """Too many credentials being checked at once (a flood of made-up ones), or the control plane's own addresses not
    resolving yet: the agent retries, as after any 5xx."""
    response = _error(503, f"{message}; retry shortly")
    response["Retry-After"] = "1"
    return response


def _auth_error(exc: Exception) -> JsonResponse:
    """A node secret refused: `protocol.NODE_UNKNOWN` only when a node secret arrived and names no node, the one 401 on
    which an agent registers again; `protocol.NODE_RETIRED` only when it is the very secret of a retired node, the one on
    which an agent stops for good; none when no secret arrived (something between dropped `Authorization`)."""
    code = {services.NodeUnknown: protocol.NODE_UNKNOWN, services.NodeRetired: protocol.NODE_RETIRED}.get(type(exc), "")
    return _error(401, str(exc), code=code)


UNRESOLVED = "the control plane's own PostgreSQL or Redis addresses do not resolve yet"


def _parse(request, message_class):
    try:
        return message_class.from_dict(json.loads(request.body or b"null"))
    except (ValueError, TypeError) as exc:
        raise _BadRequest(str(exc)) from None
    except RecursionError:  # JSON nested past what the parser takes: no message is shaped so
        raise _BadRequest("the body is nested too deeply") from None


class _BadRequest(Exception):
    pass


@csrf_exempt
@require_POST
def register(request):
    try:
        registration = _parse(request, protocol.RegisterRequest)
        answer = services.register_node(registration)
    except _BadRequest as exc:
        return _error(400, f"invalid registration: {exc}")
    except services.ReportRefused as exc:  # a usable token's host or ports: the agent stops its engines on this code
        return _error(400, f"invalid registration: {exc}", code=protocol.NODE_REFUSED)
    except services.AgentAuthError as exc:
        return _error(401, str(exc))
    except LookupsBusy:
        return _busy()
    except ServiceAddressesUnresolved:
        return _busy(UNRESOLVED)
    except services.PodTokenUnreviewed as exc:
        return _busy(f"the Kubernetes API did not review the pod's token ({exc})")
    return JsonResponse(answer.to_dict(), status=201)


@csrf_exempt
@require_POST
def heartbeat(request):
    keyword, _, secret = request.headers.get("Authorization", "").partition(" ")
    try:
        if keyword != "Bearer":
            raise services.AgentAuthError("send 'Authorization: Bearer <node secret>'")
        node = services.authenticate_node(secret.strip())
        report = _parse(request, protocol.Heartbeat)
    except services.AgentAuthError as exc:
        return _auth_error(exc)
    except LookupsBusy:
        return _busy()
    except _BadRequest as exc:
        return _error(400, f"invalid heartbeat: {exc}")
    try:
        return JsonResponse(services.record_heartbeat(node, report).to_dict())
    except services.NodeRefused as exc:
        return _error(401, str(exc), code=protocol.NODE_REFUSED)
    except ServiceAddressesUnresolved:
        return _busy(UNRESOLVED)
    except services.ReportRefused as exc:
        return _error(400, f"invalid heartbeat: {exc}")


WATCH_TIMEOUT_S = 25.0


@csrf_exempt
async def watch(request):
    """Long poll: answers `WatchResponse(changed=True)` as soon as the node's desired replicas change,
    or `changed=False` after WATCH_TIMEOUT_S. The agent then heartbeats at once.

    NOTE: on the process's one shared subscription (`controlplane.pubsub`), never a connection of
    the shared Redis pool: held cold-start requests cannot starve it."""
    if request.method != "POST":
        return _error(405, "POST only")
    keyword, _, secret = request.headers.get("Authorization", "").partition(" ")
    try:
        if keyword != "Bearer":
            raise services.AgentAuthError("send 'Authorization: Bearer <node secret>'")
        node = await services.authenticate_node_async(secret.strip())
    except services.AgentAuthError as exc:
        return _auth_error(exc)
    except LookupsBusy:
        return _busy()
    async with pubsub.subscribe(node_channel(node.pk)) as changes:
        return JsonResponse(protocol.WatchResponse(changed=await changes.wait(WATCH_TIMEOUT_S)).to_dict())
