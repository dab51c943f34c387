"""A gateway process asked to stop (SIGTERM: a rolling deploy, a scale-down) drains before its server stops.

uvicorn, told to stop, closes its listening socket at once, waits for the connections still open up to its
`--timeout-graceful-shutdown` and then cancels what still runs. A non-streamed answer may be waited for up to
`GATEWAY_MAX_ANSWER_WAIT_S` (hours), and one cancelled there was answered uvicorn's plain-text 500 and billed nothing
for what its engine had computed (its usage comes only with the whole answer); without the flag (the image's own
command) the pod's grace period ran out and the kernel's SIGKILL cut every call, its usage unwritten and its
reservation left to the sweeper.

So the first SIGTERM starts a drain here, and uvicorn hears it only when the drain ends: the inference calls this
process is handling run on up to `GATEWAY_DRAIN_S` from the signal (the manifests' `terminationGracePeriodSeconds`
less the preStop pause, uvicorn's own graceful wait for what is left, the finishes of the calls cut,
`call.SHUTDOWN_FINISH_WAIT_S`, and the usage journal's replay and shipping, `stop_budget_end`). Meanwhile a new
inference call is answered 503 `server_stopping` with its connection closed (a retry goes to another server) and
`/readyz` says not ready. Calls still running at the bound are
stopped (`InferenceCall.stop_for_shutdown`): a stream ends with an error event and is billed for what it sent (a
Responses stream, whose usage comes only in its last event, for the delta events it read and its prompt as its engine
renders it, `endpoints.gateway.rendered_prompt`, an `upstream_error` row), a call not yet answered gets the 503 and is billed nothing (the client has no answer, and the engine says its usage only with
the whole answer); each settles its reservation once, as any call ends. A second SIGINT (Ctrl-C twice) still stops
the server at once, as uvicorn does.

The hook is installed at startup (`install`) on a uvicorn server's own handler, in its main thread; anywhere else
(a test's in-process app, a batch worker) nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable

import uvicorn
from django.conf import settings

from controlplane.serve import GRACEFUL_SHUTDOWN_S

logger = logging.getLogger("inferplane.requests")

POLL_S = 0.1  # how often the drain looks whether the calls it waits for are done

_draining_since: float | None = None  # monotonic
_num_handling = 0  # inference requests being handled by this process (`handling`)
# The calls running now by request id (`endpoints.gateway.call.InferenceCall`): the ones stopped at the bound.
running: dict = {}
_drain_task: asyncio.Task | None = None
# The server's own `--timeout-graceful-shutdown` (`install`): None where no uvicorn server was found, or it has none.
_graceful_shutdown_s: float | None = None
# What the stop does after uvicorn's graceful wait (`install`): the drain leaves it room within the grace period.
_after_graceful_s = 0.0
# What a stopping process does after its last bounded step (the journal's shipping): its last counts, its clients
# closed, its exit. Kept from the grace period's end (`stop_budget_end`).
# NOTE: 3 s: a worker of several hears its SIGTERM from uvicorn's supervisor up to half a second after the pod's signal
# (the supervisor's poll), and the grace period counts from the pod's (the sixth review of this stop).
STOP_EXIT_S = 3.0


def draining() -> bool:
    """This process was asked to stop: it takes no new inference call."""
    return _draining_since is not None


def stop_budget_end(after_graceful_s: float, *, at_least: float | None = None) -> float | None:
    """When a stop's last step (the usage journal's shipping, in an outage) must be done (`time.monotonic()`); None
    when no signal came (a stop without a drain: a test's lifespan, `make run`'s Ctrl-C before any call).

    `GATEWAY_DRAIN_S`, the server's `--timeout-graceful-shutdown` and then `after_graceful_s` from the signal, as
    infra/k8s/base/web.yaml's grace period counts them, or `at_least` if that is later (the shipping's own floor, for
    steps before it that overran), but never past the pod's grace period when it is known (`GATEWAY_STOP_GRACE_S`,
    less `STOP_EXIT_S`). What the drain and the steps before did not use of their own bounds is left to the last one.

    NOTE: capped by the pod's grace period: before, a drain set within the README's rule of the time (which counted
    neither the replay, 5 s, nor the shipping, 30 s) gave a stop with grace 170 s a budget to +195 s, and an upload
    could begin that SIGKILL, at +160 s, cut (the fourth review of this shipping). And the floor within that cap:
    steps that overran by 4.4 s ended the shipping at the sum of their bounds, before its first put could begin though
    SIGKILL was 29.5 s away (the fifth). The cap is not the end itself: a grace period stated longer than the pod's (an
    overlay that shortened terminationGracePeriodSeconds) would have the shipping begin uploads SIGKILL cuts (the
    sixth)."""
    if _draining_since is None:
        return None
    end = _draining_since + settings.GATEWAY_DRAIN_S + graceful_shutdown_s() + after_graceful_s
    if at_least is not None:
        end = max(end, at_least)
    if settings.GATEWAY_STOP_GRACE_S:
        end = min(end, _draining_since + settings.GATEWAY_STOP_GRACE_S - STOP_EXIT_S)
    return end


def room_for_the_drain_s(graceful_s: float, after_graceful_s: float) -> float | None:
    """The longest drain that leaves the steps after it (uvicorn's graceful wait, `graceful_s`, and `after_graceful_s`:
    the cut calls' finishes, the journal's replay and shipping) room before the pod's grace period ends; None when
    that is not known (`GATEWAY_STOP_GRACE_S` 0)."""
    if not settings.GATEWAY_STOP_GRACE_S:
        return None
    return max(0.0, settings.GATEWAY_STOP_GRACE_S - STOP_EXIT_S - graceful_s - after_graceful_s)


def drain_bound_s() -> float:
    """How long the drain waits for the calls in flight, from the signal: `GATEWAY_DRAIN_S`, but never longer than
    leaves the steps after it room within the pod's grace period when that is known (`room_for_the_drain_s`, with
    what `install` was told follows). `manage.py check` warns of a drain cut so (`controlplane.checks`), and so does
    the process as it starts.

    NOTE: before, a drain set past that (the README's rule of the time allowed 140 s with grace 170 s) ran the cut
    calls' finishes into SIGKILL: the journal was never replayed nor shipped, and in an outage left with the pod."""
    room = room_for_the_drain_s(graceful_shutdown_s(), _after_graceful_s)
    return settings.GATEWAY_DRAIN_S if room is None else min(settings.GATEWAY_DRAIN_S, room)


def graceful_shutdown_s() -> float:
    """uvicorn's graceful wait after the drain: the `--timeout-graceful-shutdown` of the server this process runs
    (`install`), else `controlplane.serve`'s default."""
    return GRACEFUL_SHUTDOWN_S if _graceful_shutdown_s is None else _graceful_shutdown_s


class handling:  # noqa: N801 - used as a statement: `with drain.handling():`
    """Counts an inference request from its first byte to its answer, so the drain waits for it."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _num_handling
        _num_handling += 1

    def __exit__(self, *exc_info) -> None:
        global _num_handling
        _num_handling -= 1


def install(*, after_graceful_s: float = 0.0) -> bool:
    """Drain on the first SIGTERM before the uvicorn server running this loop hears it; whether it was installed.
    `after_graceful_s`: what the stop does after uvicorn's graceful wait, kept within the grace period (`drain_bound_s`)."""
    server_exit = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not isinstance(
        getattr(server_exit, "__self__", None), uvicorn.Server
    ):
        return False
    global _graceful_shutdown_s, _after_graceful_s
    _graceful_shutdown_s = server_exit.__self__.config.timeout_graceful_shutdown
    _after_graceful_s = after_graceful_s
    if drain_bound_s() < settings.GATEWAY_DRAIN_S:
        logger.warning("a stop's drain will wait %.0f s, not INFERPLANE_GATEWAY_DRAIN_S's %.0f s: the steps after it "
                       "would not fit INFERPLANE_GATEWAY_STOP_GRACE_S (%.0f s)", drain_bound_s(),
                       settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S)
    loop = asyncio.get_running_loop()

    def on_sigterm(signum, frame) -> None:
        global _draining_since
        # NOTE: once: a SIGTERM to the process group reaches a worker twice (again from its supervisor), and uvicorn
        # too stops at once only on a second SIGINT, which still reaches it unchanged.
        if _draining_since is not None:
            return
        _draining_since = time.monotonic()
        loop.call_soon_threadsafe(_start, lambda: server_exit(signum, None))

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _start(stop_server: Callable[[], None]) -> None:
    global _drain_task
    _drain_task = asyncio.ensure_future(_drain(stop_server))


async def _drain(stop_server: Callable[[], None]) -> None:
    bound_s = drain_bound_s()
    deadline = _draining_since + bound_s
    if bound_s < settings.GATEWAY_DRAIN_S:
        logger.warning("stopping: the drain waits %.0f s, not INFERPLANE_GATEWAY_DRAIN_S's %.0f s: the steps after it "
                       "would not fit the grace period (INFERPLANE_GATEWAY_STOP_GRACE_S)", bound_s, settings.GATEWAY_DRAIN_S)
    if _num_handling:
        logger.warning("stopping: %d call(s) in flight, waited for up to %.0f s", _num_handling, bound_s)
    try:
        while _num_handling and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if running:
            logger.warning(
                "stopping: %d call(s) still running at the drain's bound are stopped", len(running)
            )
            for call in list(running.values()):
                call.stop_for_shutdown()
    finally:
        stop_server()
