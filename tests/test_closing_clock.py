"""A close is stamped by PostgreSQL's clock (`Organization.closed_at`, and its audit events' `created_at`), as every
money rule judges time (`controlplane.clock`): the subscription ends once what was recorded up to the close is billed.

Before: the web pod's own clock stamped both; a pod ten minutes ahead dated the close ten minutes into the future,
and its audit events around it out of order with what the database's clock stamped."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.utils import timezone as django_timezone

from controlplane.accounts.models import AuditEvent, Role
from controlplane.accounts.services import Actor
from controlplane.clock import database_now
from endpoints import closing
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db

AHEAD = timedelta(minutes=10)


class _PodClockAhead(datetime):
    """This process's clock, ten minutes ahead of the database's (a VM resumed, NTP broken)."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + AHEAD


def test_a_close_through_a_web_pod_whose_clock_is_ahead_is_stamped_by_the_databases_clock(monkeypatch):
    organization = OrganizationFactory()
    owner = UserFactory()
    MembershipFactory(organization=organization, user=owner, role=Role.OWNER)

    with monkeypatch.context() as web_pod:
        web_pod.setattr(django_timezone, "datetime", _PodClockAhead)
        assert django_timezone.now() - database_now() > AHEAD - timedelta(minutes=1)
        closed = closing.close_organization(Actor(user=owner), organization, confirm_name=organization.name)
        event = AuditEvent.objects.get(organization=organization, action="organization.close")
    after = database_now()

    assert after - timedelta(minutes=1) < closed.closed_at <= after
    assert after - timedelta(minutes=1) < event.created_at <= after
