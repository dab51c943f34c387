"""Mail a request asks for, sent off the request by this web process's own sender threads (`send_later`): the
password reset's link and its "no account has this address" mail, so that the reset is answered at once, in the same
time whichever it mails, whatever the relay does.

NOTE: not a Celery task (a review dropped that design: a flood of resets with the relay slow held the default queue's
slots the autoscaler and cold-start wakes need, and a worker of the release before dropped the unknown task's message
during a rollout). These threads are the web process's own: at most `NUM_SENDERS` wait on the relay (each send bounded
by `EMAIL_TIMEOUT`), at most `MAX_BACKLOG` mails wait for them (past it a mail is dropped and logged at ERROR, never
held in memory without bound), and a process that stops waits up to `EMAIL_TIMEOUT` for its backlog (`send_backlog_before_stopping`: the lifespan's shutdown, `atexit`), the
mails still waiting then logged at ERROR. A mail that fails is logged at ERROR with what it was, as the request's
own send logged it before; it is not tried again (the asker may ask again: the form's limits allow a few)."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.core.mail import EmailMessage

logger = logging.getLogger(__name__)

NUM_SENDERS = 2
MAX_BACKLOG = 500  # mails waiting for a sender, a few KB each

_lock = threading.Lock()
_backlog: queue.Queue[tuple[EmailMessage, str, Callable[[], bool] | None]] | None = None
_pid: int | None = None  # the process whose threads serve `_backlog` (a forked child starts its own)


def send_later(message: EmailMessage, *, what: str, only_if: Callable[[], bool] | None = None) -> bool:
    """Send `message` off this request, by a sender thread; whether it was taken (False: the backlog is full, the mail
    dropped and logged). `what` names it in the logs (never its body: a link is a secret). `only_if`, where given, is
    asked by the sender just before it sends (a budget to spend, a Redis call): False, the mail is not sent.

    NOTE: `only_if` is the sender's, not the request's: a reset without an account spent its no-account budget (a
    Redis round trip) within the request, one with an account nothing, and the answer's time told them apart.

    With `settings.SEND_MAIL_IN_REQUEST` (the tests' default, where `mail.outbox` is read as the request returns) it is
    sent here, a failure logged the same."""
    if settings.SEND_MAIL_IN_REQUEST:
        _send(message, what, only_if)
        return True
    try:
        _senders().put_nowait((message, what, only_if))
    except queue.Full:
        logger.error("dropped %s: %d mails already wait for the relay", what, MAX_BACKLOG)
        return False
    return True


def wait_until_sent(timeout_s: float) -> bool:
    """Wait up to `timeout_s` for every mail taken so far to be sent (or to fail); whether they all were."""
    backlog = _backlog
    if backlog is None:
        return True
    deadline = time.monotonic() + timeout_s
    with backlog.all_tasks_done:
        while backlog.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            backlog.all_tasks_done.wait(left)
    return True


def _send(message: EmailMessage, what: str, only_if: Callable[[], bool] | None = None) -> None:
    try:
        if only_if is not None and not only_if():
            return
        message.send()
    except Exception:
        logger.exception("Failed to send %s", what)


def _senders() -> queue.Queue:
    global _backlog, _pid
    with _lock:
        if _backlog is None or _pid != os.getpid():
            _backlog, _pid = queue.Queue(maxsize=MAX_BACKLOG), os.getpid()
            for n in range(NUM_SENDERS):
                threading.Thread(target=_serve, args=(_backlog,), name=f"mail-sender-{n}", daemon=True).start()
        return _backlog


def _serve(backlog: queue.Queue) -> None:
    while True:
        message, what, only_if = backlog.get()
        try:
            _send(message, what, only_if)
        finally:
            backlog.task_done()


def send_backlog_before_stopping() -> None:
    """Wait up to `EMAIL_TIMEOUT` for the mails this process took, the ones still waiting then logged at ERROR: at the
    web application's lifespan shutdown (`controlplane.asgi`), and at exit.

    NOTE: `atexit` alone never ran on a pod's stop: uvicorn raises the SIGTERM again after its graceful shutdown, with
    its default action (`uvicorn.Server.capture_signals`), and the process is killed, the mails lost unlogged."""
    if _pid == os.getpid() and not wait_until_sent(settings.EMAIL_TIMEOUT):
        logger.error("stopping with %d mails unsent", _backlog.unfinished_tasks if _backlog is not None else 0)


atexit.register(send_backlog_before_stopping)
