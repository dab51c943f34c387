"""Abandoning a held rollup's "send the difference" (`stripe_sync.abandon_held_difference`) and a run of it sending
at the same moment: one of them wins, never both."""

import threading
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from billing import stripe_sync
from billing.models import MeterEventPush, UsageRollup
from controlplane.accounts.models import AuditEvent
from controlplane.accounts.services import SYSTEM
from tests.billing.test_held_difference_claims import _billed_as_the_ledger, _run_killed_before_recording
from tests.billing.test_held_duplicates import _held_with_more_than_stripe, _send_difference

pytestmark = pytest.mark.django_db(transaction=True)


def _abandon_while_a_run_sends(fake_stripe, monkeypatch, abandoning_pod=nullcontext):
    """A rollup whose first run died before recording its event (Stripe truthfully has it not), a second staff run
    sending it, and an abandon sent at that moment from `abandoning_pod` (a context: the pod's clock): the rollup, what
    the abandon answered (its count, or its refusal's words) and what the run returned."""
    rollup, stripe_has = _held_with_more_than_stripe(fake_stripe)
    _run_killed_before_recording(monkeypatch, rollup, stripe_has)
    del fake_stripe.meter_events[stripe_sync.difference_identifier(rollup, "inferplane_input_tokens")]
    fake_stripe.forget_idempotency_keys()
    UsageRollup.objects.filter(pk=rollup.pk).update(difference_started_at=timezone.now() - timedelta(hours=25))

    original, sending, abandon_tried, run = stripe_sync._send_difference, threading.Event(), threading.Event(), {}

    def send_while_staff_abandons(*args):
        sending.set()
        abandon_tried.wait(10)
        return original(*args)

    def second_run():
        try:
            run["marked"] = _send_difference(rollup, stripe_has, pending_in_stripe=False)
        except Exception as exc:  # noqa: BLE001 (the test reports it)
            run["error"] = exc
        finally:
            sending.set()
            connection.close()

    monkeypatch.setattr(stripe_sync, "_send_difference", send_while_staff_abandons)
    thread = threading.Thread(target=second_run)
    thread.start()
    assert sending.wait(10)
    try:
        with abandoning_pod():
            abandoned = stripe_sync.abandon_held_difference(SYSTEM, rollup.pk, difference_in_stripe=False)
    except stripe_sync.DifferenceRefused as refused:
        abandoned = str(refused)
    finally:
        abandon_tried.set()
    thread.join(20)
    return rollup, abandoned, run


def test_abandoning_a_difference_while_a_run_sends_it_is_refused_and_the_run_bills_it_once(fake_stripe, monkeypatch):
    # Before, a second staff run (its lost event truthfully answered "not in Stripe") was sending while another staff
    # member abandoned the difference, also answering "not in Stripe": the abandon cleared the claim, the run's event
    # went to Stripe and was recorded after it, and the rollup stayed held with a difference event that a later run
    # with other values would take as its own (the test saw the abandon return 1 and the run 0).
    rollup, abandoned, run = _abandon_while_a_run_sends(fake_stripe, monkeypatch)

    assert "is sending it now" in str(abandoned), abandoned
    assert run == {"marked": 1}
    assert not AuditEvent.objects.filter(action=stripe_sync.ABANDON_DIFFERENCE_AUDIT_ACTION).exists()
    rollup.refresh_from_db()
    assert rollup.pushed_at is not None and rollup.push_held_at is None
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}
    assert MeterEventPush.objects.filter(rollup=rollup).exists()


def test_an_abandon_on_a_pod_whose_clock_runs_ahead_is_refused_while_a_run_sends(fake_stripe, monkeypatch):
    # The claim to send (`push_claimed_at`) was stamped by the run's pod's clock and judged by the abandoning pod's:
    # one whose clock ran past `BILLING_CLAIM_TIMEOUT_S` ahead took a run sending at that moment for one that died,
    # and the abandon went through under it (the test saw it return 1). Both are PostgreSQL's clock now.
    honest_now, ahead = timezone.now, timedelta(seconds=settings.BILLING_CLAIM_TIMEOUT_S + 60)

    @contextmanager
    def pod_ahead():
        with pytest.MonkeyPatch.context() as pod:
            pod.setattr(timezone, "now", lambda: honest_now() + ahead)
            yield

    rollup, abandoned, run = _abandon_while_a_run_sends(fake_stripe, monkeypatch, pod_ahead)

    assert "is sending it now" in str(abandoned), abandoned
    assert run == {"marked": 1}
    assert not AuditEvent.objects.filter(action=stripe_sync.ABANDON_DIFFERENCE_AUDIT_ACTION).exists()
    assert _billed_as_the_ledger(fake_stripe, rollup) == {}

