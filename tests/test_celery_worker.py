"""Tasks run in a real Celery worker process over the real Redis broker, never eagerly."""

import pytest

from controlplane.tasks import ping
from endpoints.models import Endpoint, Replica
from endpoints.replicas import request_reconcile
from tests.factories import EndpointFactory
from tests.processes import wait_until


def test_a_real_worker_runs_a_task(celery_worker):
    result = ping.delay("hello from the test")
    assert result.get(timeout=60) == "hello from the test"


@pytest.mark.django_db(transaction=True)
def test_the_worker_reconciles_an_endpoint_without_capacity_into_waiting(celery_worker):
    endpoint = EndpointFactory(min_replicas=1, max_replicas=1)
    from endpoints.tasks import reconcile_endpoint

    reconcile_endpoint.delay(str(endpoint.pk)).get(timeout=60)
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type l4"
    assert not Replica.objects.filter(endpoint=endpoint).exists()


@pytest.mark.django_db(transaction=True)
def test_a_requested_reconcile_reaches_the_worker_after_commit(celery_worker):
    endpoint = EndpointFactory(min_replicas=1, max_replicas=1)
    request_reconcile(endpoint.pk)  # sent by the task's name: the worker must know it
    wait_until(lambda: Endpoint.objects.get(pk=endpoint.pk).status_message, 60, message="the reconcile to run")
    endpoint.refresh_from_db()
    assert endpoint.status_message == "waiting for capacity: no READY node of GPU type l4"


@pytest.mark.django_db(transaction=True)
def test_a_password_reset_form_queues_its_mail_for_a_worker(celery_worker, monkeypatch):
    """The form's mail (the link, or that no account has the address) is a worker's: before, it was sent within the
    request, and an address with an account was answered after SMTP's round trips. The form sends nothing itself."""
    from django.core import mail
    from django.test import Client
    from django.urls import reverse

    from tests.factories import UserFactory

    monkeypatch.undo()  # conftest's `_password_reset_mail_in_process`: here the real worker runs it
    UserFactory(username="owner@example.test")
    for email in ("owner@example.test", "nobody@example.test"):
        response = Client().post(reverse("password_reset"), {"email": email})
        assert (response.status_code, response["Location"]) == (302, reverse("password_reset_done"))
    assert mail.outbox == []

    def num_succeeded() -> int:
        return sum("accounts.mail_password_reset[" in line and "succeeded" in line
                   for line in celery_worker.log_text().splitlines())

    wait_until(lambda: num_succeeded() == 2, 60, message="the worker to run both resets' mail")
