"""A staff page out of date saves nothing: a field changed since the page was shown (by the organisation's owner, a
tenant, another staff member) is refused, and the change made meanwhile stands. Each test submits the page as a browser
does: every field the page holds, as it showed them, with the one the staff member edited."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import Group
from django.db import connections
from django.test import Client
from django.urls import reverse

from billing.models import BillingAccount, BillingMode
from billing.quota.counters import QuotaExceeded
from billing.services import set_spend_cap
from controlplane.accounts import admin as accounts_admin
from controlplane.accounts.models import AuditEvent, Plan, Role
from controlplane.accounts.services import SYSTEM, Actor, save_plan
from controlplane.accounts.stale_edits import CHANGED_SINCE_SHOWN
from endpoints.catalogue import GPU_TYPES
from endpoints.fleet import pool_services
from endpoints.fleet.pool_services import create_node_pool, update_node_pool
from endpoints.models import Endpoint
from endpoints.nodes.models import NodePool
from endpoints.services import update_endpoint
from tests.billing.test_billing_paths import _reserve
from tests.factories import EndpointFactory, MembershipFactory, UserFactory, sign_in_staff

pytestmark = pytest.mark.django_db


class _Form(HTMLParser):
    """The values a browser submits from a page's forms: named inputs (ticked boxes only), selects and textareas."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.values: dict[str, list[str]] = {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        name = attrs.get("name")
        if tag == "input" and name and "disabled" not in attrs and attrs.get("type") not in ("submit", "button"):
            if attrs.get("type") in ("checkbox", "radio"):
                if "checked" in attrs:
                    self.values.setdefault(name, []).append(attrs.get("value") or "on")  # a browser's default
            else:
                self.values.setdefault(name, []).append(attrs.get("value") or "")
        elif tag == "select" and name:
            self._select = name
            self.values.setdefault(name, [])
        elif tag == "option" and self._select and "selected" in attrs:
            self.values[self._select].append(attrs.get("value") or "")
        elif tag == "textarea" and name:
            self._textarea = name
            self.values[name] = [""]

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data):
        if self._textarea:
            self.values[self._textarea][0] += data.removeprefix("\n") if not self.values[self._textarea][0] else data


def _as_shown(client, url: str) -> dict[str, list[str]]:
    page = client.get(url)
    assert page.status_code == 200, page.content.decode()[:500]
    form = _Form()
    form.feed(page.content.decode())
    form.values.pop("csrfmiddlewaretoken", None)
    return form.values


def _shown_again(response) -> dict[str, list[str]]:
    """The values the page an admin's submit got back (refused, shown again) submits as it stands."""
    form = _Form()
    form.feed(response.content.decode())
    form.values.pop("csrfmiddlewaretoken", None)
    return form.values


def _refused(response, field: str) -> None:
    """The page came back with `field` refused as changed since it was shown (the admin's 200, the fleet page's 400)."""
    assert response.status_code in (200, 400), response.content.decode()[:3000]
    form = response.context["adminform"].form if "adminform" in response.context else response.context["form"]
    assert form.errors.get(field) == [CHANGED_SINCE_SHOWN], form.errors


@pytest.mark.django_db(transaction=True)  # NOTE: the gateway's admission reads the account on its own connection
def test_a_spend_cap_its_owner_lowered_after_staff_opened_the_account_stays_lowered_when_staff_save(staff_client):
    # Before, the page sent the cap it had shown ($500) with the billing mode staff switched, and the service saved
    # what differed from the row: the owner's $50 was $500 again, audited as staff's change, and the gateway let the
    # organisation spend past the cap its owner had set.
    endpoint = EndpointFactory()
    organization = endpoint.organization
    owner = MembershipFactory(organization=organization, role=Role.OWNER).user
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("500"))
    account = BillingAccount.objects.for_organization(organization.pk)
    url = reverse("admin:billing_billingaccount_change", args=[account.pk])
    shown = _as_shown(staff_client, url)
    assert Decimal(shown["spend_cap"][0]) == Decimal("500")

    set_spend_cap(Actor(user=owner), organization, spend_cap=Decimal("0.50"))  # meanwhile, through the API's service
    response = staff_client.post(url, {**shown, "mode": [BillingMode.PREPAID]})

    _refused(response, "spend_cap")
    account.refresh_from_db()
    assert (account.spend_cap, account.mode) == (Decimal("0.50"), BillingMode.POSTPAID)
    assert not AuditEvent.objects.filter(actor=staff_client.staff, action__startswith="billing.").exists()
    with pytest.raises(QuotaExceeded):
        _reserve(organization, "past the owner's cap")


def test_a_billing_account_page_shown_and_saved_with_nothing_changed_meanwhile_saves_as_before(staff_client):
    organization = EndpointFactory().organization
    account = BillingAccount.objects.for_organization(organization.pk)
    url = reverse("admin:billing_billingaccount_change", args=[account.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "spend_cap": ["20"]})

    assert response.status_code == 302, response.content.decode()[:3000]
    assert BillingAccount.objects.for_organization(organization.pk).spend_cap == Decimal("20")
    event = AuditEvent.objects.get(action="billing.set_spend_cap")
    assert event.actor == staff_client.staff


def test_an_account_with_a_cap_saves_its_page_as_shown_with_another_field_changed(staff_client):
    # Before, the page showed the cap with the column's nine places, which its own field refused (two at most): no
    # field of an account with a cap could be saved without the cap typed again.
    organization = EndpointFactory().organization
    set_spend_cap(SYSTEM, organization, spend_cap=Decimal("500"))
    account = BillingAccount.objects.for_organization(organization.pk)
    url = reverse("admin:billing_billingaccount_change", args=[account.pk])

    response = staff_client.post(url, {**_as_shown(staff_client, url), "mode": [BillingMode.PREPAID]})

    assert response.status_code == 302, response.content.decode()[:3000]
    account.refresh_from_db()
    assert (account.spend_cap, account.mode) == (Decimal("500"), BillingMode.PREPAID)
    assert not AuditEvent.objects.filter(action="billing.set_spend_cap", actor=staff_client.staff).exists()


def test_prices_that_followed_a_tenants_move_to_another_gpu_are_not_put_back_by_a_page_shown_before(staff_client):
    # Before, a page shown while the endpoint ran on L4 sent L4's prices back with the batch fraction staff changed:
    # the endpoint, on H100 since, was billed at L4's prices.
    endpoint = EndpointFactory(gpu_type="l4")
    url = reverse("admin:endpoints_endpoint_change", args=[endpoint.pk])
    shown = _as_shown(staff_client, url)

    owner = MembershipFactory(organization=endpoint.organization, role=Role.OWNER).user
    update_endpoint(Actor(user=owner), endpoint, gpu_type="h100-80gb")
    response = staff_client.post(url, {**shown, "batch_price_fraction": ["0.4"]})

    _refused(response, "price_input_per_million")
    endpoint = Endpoint.objects.get(pk=endpoint.pk)
    assert endpoint.price_input_per_million == GPU_TYPES["h100-80gb"].price_input_per_million
    assert endpoint.price_output_per_million == GPU_TYPES["h100-80gb"].price_output_per_million
    assert not AuditEvent.objects.filter(action="endpoint.prices").exists()


def test_a_plan_another_staff_member_changed_since_the_page_was_shown_keeps_their_change(staff_client):
    plan = save_plan(SYSTEM, Plan(name="team", max_endpoints=10, max_replicas=8, max_min_replicas=2,
                                  max_held_requests=64, max_file_bytes=1 << 20))
    url = reverse("admin:controlplane_plan_change", args=[plan.pk])
    shown = _as_shown(staff_client, url)

    plan.max_replicas = 2
    save_plan(SYSTEM, plan)  # another staff member lowers the plan's replicas
    response = staff_client.post(url, {**shown, "max_endpoints": ["12"]})

    _refused(response, "max_replicas")
    plan.refresh_from_db()
    assert (plan.max_replicas, plan.max_endpoints) == (2, 10)


def test_an_account_deactivated_since_its_page_was_shown_is_not_reactivated_by_saving_it(staff_client):
    # Before, a page shown before another staff member deactivated a compromised account sent `is_active` ticked with
    # a change of name: the account could sign in again.
    user = UserFactory()
    url = reverse("admin:auth_user_change", args=[user.pk])
    shown = _as_shown(staff_client, url)
    assert shown["is_active"] == ["on"]

    type(user).objects.filter(pk=user.pk).update(is_active=False)
    response = staff_client.post(url, {**shown, "first_name": ["Mallory"]})

    _refused(response, "is_active")
    user.refresh_from_db()
    assert not user.is_active and user.first_name == ""


def test_a_user_page_saved_after_the_user_signed_in_again_saves(staff_client):
    # `last_login` is a fact each sign-in changes, not something staff edit: it never makes a page out of date.
    user = UserFactory()
    url = reverse("admin:auth_user_change", args=[user.pk])
    shown = _as_shown(staff_client, url)

    type(user).objects.filter(pk=user.pk).update(last_login="2030-01-01T00:00:00Z")
    response = staff_client.post(url, {**shown, "first_name": ["Alice"]})

    assert response.status_code == 302, response.content.decode()[:3000]
    user.refresh_from_db()
    assert user.first_name == "Alice" and user.last_login.year == 2030


@pytest.mark.parametrize("page", ["fleet", "admin"])
def test_a_node_pools_max_lowered_since_its_page_was_shown_is_not_raised_again(staff_client, page):
    pool = create_node_pool(SYSTEM, name="l4-local", gpu_type="l4", provider="local", max_nodes=8)
    url = (reverse("console:pool-edit", args=[pool.pk]) if page == "fleet"
           else reverse("admin:gpu_agent_nodepool_change", args=[pool.pk]))
    shown = _as_shown(staff_client, url)

    update_node_pool(SYSTEM, pool, max_nodes=1)  # another staff member, through the pools' API
    response = staff_client.post(url, {**shown, "idle_timeout_s": ["900"]})

    _refused(response, "max_nodes")
    pool = NodePool.objects.get(pk=pool.pk)
    assert (pool.max_nodes, pool.idle_timeout_s) == (1, 600)


def test_a_page_shown_again_for_a_mistake_saves_once_corrected_when_nothing_changed_meanwhile(staff_client):
    # Before, a list shown empty (no groups) said nothing of what it showed; the page shown again for a mistaken
    # address then claimed to have shown the groups staff had just picked, and its corrected save was refused as
    # "changed by someone else" though nobody had changed anything.
    group = Group.objects.create(name="support")
    user = UserFactory()
    url = reverse("admin:auth_user_change", args=[user.pk])

    again = staff_client.post(url, {**_as_shown(staff_client, url), "groups": [str(group.pk)], "email": ["not-an-address"]})
    assert again.status_code == 200 and "email" in again.context["adminform"].form.errors
    form = _Form()
    form.feed(again.content.decode())
    form.values.pop("csrfmiddlewaretoken", None)
    response = staff_client.post(url, {**form.values, "email": ["alice@example.com"]})

    assert response.status_code == 302, response.context["adminform"].form.errors
    assert list(user.groups.all()) == [group]


def test_an_account_whose_stored_address_django_folds_differently_can_still_be_deactivated(staff_client):
    # An address stored before sign-up folded it (NFKC: a fullwidth letter) is shown as stored, and Django's username
    # field folds what the page posts. Before, the page's own shown value, folded, differed from the row on every
    # submit: "changed by someone else", always, and staff could never deactivate the account from its page.
    user = UserFactory()
    type(user).objects.filter(pk=user.pk).update(username="ada@\uff45xample.test", email="ada@\uff45xample.test")
    url = reverse("admin:auth_user_change", args=[user.pk])
    shown = _as_shown(staff_client, url)
    del shown["is_active"]  # unticked

    response = staff_client.post(url, shown)

    assert response.status_code == 302, response.context["adminform"].form.errors
    user.refresh_from_db()
    assert not user.is_active


def _saving_at_once(monkeypatch, module, name: str) -> None:
    """`module.name` (the service a page saves through) waits, at most 2 s, for the other save to reach it too: only two
    saves whose comparisons both passed meet there (with the row locked, the second waits for the first's commit)."""
    both_compared = threading.Barrier(2)
    real = getattr(module, name)

    def compared_then_waiting(*args, **kwargs):
        try:
            both_compared.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, compared_then_waiting)


@pytest.mark.django_db(transaction=True)  # NOTE: two staff members' saves, each on its own connection
@pytest.mark.parametrize("page", ["plan", "fleet pool", "admin pool"])
def test_two_staff_saves_of_one_page_at_once_keep_one_and_refuse_the_other(monkeypatch, page):
    # Before, the comparison with what the page showed was not under the row's lock: two saves a few milliseconds
    # apart both read the row before either wrote, both passed, and the second wrote back what the first changed.
    if page == "plan":
        row = save_plan(SYSTEM, Plan(name="team", max_endpoints=10, max_replicas=8, max_min_replicas=2,
                                     max_held_requests=64, max_file_bytes=1 << 20))
        url = reverse("admin:controlplane_plan_change", args=[row.pk])
        edits = [{"max_replicas": ["2"]}, {"max_endpoints": ["12"]}]
        _saving_at_once(monkeypatch, accounts_admin, "save_plan")
    else:
        row = create_node_pool(SYSTEM, name="l4-local", gpu_type="l4", provider="local", max_nodes=8)
        url = (reverse("console:pool-edit", args=[row.pk]) if page == "fleet pool"
               else reverse("admin:gpu_agent_nodepool_change", args=[row.pk]))
        edits = [{"max_nodes": ["1"]}, {"idle_timeout_s": ["900"]}]
        _saving_at_once(monkeypatch, pool_services, "update_node_pool")
    clients = []
    for _ in edits:
        client = Client()
        sign_in_staff(client, UserFactory(is_staff=True, is_superuser=True))
        clients.append(client)
    shown = [_as_shown(client, url) for client in clients]

    def save(n):
        try:
            response = clients[n].post(url, {**shown[n], **edits[n]})
            if response.status_code == 302:
                return "saved"
            _refused(response, next(iter(edits[1 - n])))
            return "refused"
        finally:
            connections.close_all()

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(save, range(2)))

    assert sorted(outcomes) == ["refused", "saved"]
    winner = edits[outcomes.index("saved")]
    row.refresh_from_db()
    if page == "plan":
        assert (row.max_replicas, row.max_endpoints) == ((2, 10) if "max_replicas" in winner else (8, 12))
    else:
        assert (row.max_nodes, row.idle_timeout_s) == ((1, 600) if "max_nodes" in winner else (8, 900))
