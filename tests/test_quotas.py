"""Per-organisation quotas: one free account cannot hold the fleet. Specs past the plan are a 400
naming the quota, the autoscaler never places past it (and says why), and staff change plans
through an audited path."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client

from controlplane.accounts.models import AuditEvent, Organization, Plan
from controlplane.accounts.services import SYSTEM, save_plan, set_organization_plan
from controlplane.accounts.tenancy import SESSION_KEY
from endpoints import scheduler, services
from endpoints.autoscaler import Load
from endpoints.models import Endpoint, Replica
from endpoints.quotas import QuotaExceeded
from tests.factories import EndpointFactory, MembershipFactory, OrganizationFactory, sign_in_staff
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

# A model one L4 holds: each replica is one GPU (tests/test_gpus_per_replica.py counts wider ones).
VALID = {"name": "llama-chat", "model_source": "hf:meta-llama/Llama-3.2-3B-Instruct", "gpu_type": "l4"}


def _on_plan(organization, **quotas) -> Plan:
    plan = save_plan(SYSTEM, Plan(name=f"plan-{organization.pk}", **quotas))
    set_organization_plan(SYSTEM, organization, plan)
    return plan


def test_a_free_account_cannot_ask_for_a_hundred_warm_replicas(owner_client):
    asked = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 100, "max_replicas": 100}, format="json")

    assert asked.status_code == 400
    assert "quota max_replicas" in asked.json()["max_replicas"][0]
    assert not Endpoint.objects.exists()


def test_specs_past_the_plan_are_a_400_with_a_field_error_naming_each_quota(owner_client, org):
    _on_plan(org, max_endpoints=2, max_replicas=4, max_min_replicas=1, max_gpus_by_type={"h100-80gb": 0})

    too_many_replicas = owner_client.post("/api/v1/endpoints/", VALID | {"max_replicas": 5}, format="json")
    no_h100 = owner_client.post("/api/v1/endpoints/", VALID | {"gpu_type": "h100-80gb"}, format="json")
    first = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 1}, format="json")
    second_warm = owner_client.post("/api/v1/endpoints/", VALID | {"name": "two", "min_replicas": 1}, format="json")
    second = owner_client.post("/api/v1/endpoints/", VALID | {"name": "two"}, format="json")
    third = owner_client.post("/api/v1/endpoints/", VALID | {"name": "three"}, format="json")

    assert too_many_replicas.status_code == 400 and "at most 4 replicas" in too_many_replicas.json()["max_replicas"][0]
    assert no_h100.status_code == 400 and "quota max_gpus_by_type" in no_h100.json()["gpu_type"][0]
    assert first.status_code == 201
    assert second_warm.status_code == 400 and "quota max_min_replicas" in second_warm.json()["min_replicas"][0]
    assert second.status_code == 201
    assert third.status_code == 400 and "quota max_endpoints" in third.json()["name"][0]
    raised = owner_client.patch(f"/api/v1/endpoints/{second.json()['id']}/", {"min_replicas": 1}, format="json")
    assert raised.status_code == 400 and "at most 0 here" in raised.json()["min_replicas"][0]


def test_a_lowered_plan_still_lets_an_endpoint_change_what_quotas_do_not_cover(owner_client, org):
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 1}, format="json").json()["id"]
    _on_plan(org, max_min_replicas=0)

    patched = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"idle_timeout_s": 600}, format="json")

    assert patched.status_code == 200, patched.json()


ALWAYS_OPEN = {"schedule": "* * * * *", "timezone": "UTC", "duration_minutes": 10080, "min_replicas": 8}


def test_a_pre_warm_window_keeps_no_more_replicas_warm_than_the_plan_allows(owner_client, org):
    """Before, a window open all the time kept max_replicas warm where the quota allowed 2."""
    forever = owner_client.post("/api/v1/endpoints/", VALID | {"max_replicas": 8, "prewarm_windows": [ALWAYS_OPEN]},
                                format="json")
    assert forever.status_code == 400, forever.json()
    assert "quota max_min_replicas" in forever.json()["prewarm_windows"][0]
    assert "one here keeps 8" in forever.json()["prewarm_windows"][0]
    assert not Endpoint.objects.exists()

    warm = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 1, "max_replicas": 2}, format="json")
    second = owner_client.post("/api/v1/endpoints/", VALID | {"name": "two", "max_replicas": 2}, format="json")
    assert warm.status_code == 201 and second.status_code == 201
    windowed = owner_client.patch(f"/api/v1/endpoints/{second.json()['id']}/",
                                  {"prewarm_windows": [ALWAYS_OPEN | {"min_replicas": 2}]}, format="json")
    assert windowed.status_code == 400 and "so at most 1 here" in windowed.json()["prewarm_windows"][0]
    fits = owner_client.patch(f"/api/v1/endpoints/{second.json()['id']}/",
                              {"prewarm_windows": [ALWAYS_OPEN | {"min_replicas": 1}]}, format="json")
    assert fits.status_code == 200, fits.json()
    rows = {row["quota"]: row["used"] for row in owner_client.get("/api/v1/quotas/").json()["quotas"]}
    assert rows["max_min_replicas"] == 2
    # Now the window counts: min_replicas elsewhere has no room left.
    raised = owner_client.patch(f"/api/v1/endpoints/{warm.json()['id']}/", {"min_replicas": 2}, format="json")
    assert raised.status_code == 400 and "your other endpoints keep 1" in raised.json()["min_replicas"][0]


def test_a_lowered_plan_never_refuses_keeping_fewer_replicas_warm(owner_client, org):
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID | {"min_replicas": 2, "max_replicas": 2},
                                    format="json").json()["id"]
    _on_plan(org, max_min_replicas=0)

    lowered = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"min_replicas": 1}, format="json")

    assert lowered.status_code == 200, lowered.json()
    raised = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"min_replicas": 2}, format="json")
    assert raised.status_code == 400 and "at most 0 here" in raised.json()["min_replicas"][0]


def test_a_plan_lowered_below_an_endpoints_gpus_still_lets_its_warm_settings_change(owner_client, org):
    # Removing a pre-warm window (or lowering min_replicas) ran the GPU quota's checks too, refused on max_replicas.
    endpoint_id = owner_client.post("/api/v1/endpoints/", VALID | {"max_replicas": 2, "prewarm_windows": [
        {"schedule": "0 9 * * 1-5", "timezone": "UTC", "duration_minutes": 60, "min_replicas": 1}]},
        format="json").json()["id"]
    _on_plan(org, max_replicas=1, max_gpus_by_type={VALID["gpu_type"]: 1})

    cleared = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"prewarm_windows": []}, format="json")

    assert cleared.status_code == 200, cleared.json()
    raised = owner_client.patch(f"/api/v1/endpoints/{endpoint_id}/", {"max_replicas": 3}, format="json")
    assert raised.status_code == 400 and "max_replicas" in raised.json()


def test_the_autoscaler_never_scales_an_organisation_past_its_replica_quota_and_the_endpoint_says_why(org):
    _on_plan(org, max_replicas=3, max_gpus_by_type={"l4": 3})
    first = EndpointFactory(organization=org, gpu_type="l4", max_replicas=3, target_concurrency=1)
    second = EndpointFactory(organization=org, gpu_type="l4", max_replicas=3, target_concurrency=1)
    other_tenant = EndpointFactory(gpu_type="l4", max_replicas=3, target_concurrency=1)
    for _ in range(3):
        make_node(memory_mb=80_000)
    busy = Load(num_inflight=10, num_waiting=0, last_request_at=time.time(), peak_concurrency=10)

    for endpoint in (first, second, other_tenant):
        scheduler.reconcile_endpoint(str(endpoint.pk), busy)

    assert Replica.objects.filter(endpoint__organization=org).count() == 3
    assert Replica.objects.filter(endpoint=other_tenant).count() == 3  # other tenants are not held back
    second.refresh_from_db()
    assert second.status_message.startswith("waiting for quota: your plan allows 3 replicas at once")


def test_the_gpu_type_quota_bounds_placement_too(org):
    _on_plan(org, max_replicas=8, max_gpus_by_type={"l4": 1})
    endpoint = EndpointFactory(organization=org, gpu_type="l4", max_replicas=3, target_concurrency=1)
    make_node(memory_mb=80_000)

    scheduler.reconcile_endpoint(str(endpoint.pk), Load(5, 0, time.time(), 5))

    endpoint.refresh_from_db()
    assert endpoint.replicas.count() == 1
    assert endpoint.status_message == "waiting for quota: your plan allows 1 l4 GPUs at once and your endpoints hold 1"


def test_the_api_shows_quotas_and_current_use(owner_client, org):
    _on_plan(org, max_endpoints=5, max_replicas=4, max_gpus_by_type={"h100-80gb": 1})
    endpoint = EndpointFactory(organization=org, gpu_type="l4", min_replicas=1)
    Replica.objects.create(endpoint=endpoint)

    body = owner_client.get("/api/v1/quotas/").json()

    rows = {row["quota"]: (row["used"], row["limit"]) for row in body["quotas"]}
    assert body["plan"] == f"plan-{org.pk}"
    assert rows["max_endpoints"] == (1, 5) and rows["max_replicas"] == (1, 4)
    assert rows["max_min_replicas"] == (1, 2) and rows["max_held_requests"] == (0, 64)
    assert rows["max_gpus_by_type.h100-80gb"] == (0, 1) and rows["max_gpus_by_type.l4"] == (1, 4)


def test_the_console_shows_quotas_and_current_use(org):
    membership = MembershipFactory(organization=org, role="owner")
    EndpointFactory(organization=org)
    client = Client()
    client.force_login(membership.user)
    session = client.session
    session[SESSION_KEY] = org.pk
    session.save()

    page = client.get("/console/endpoints/").content.decode()

    assert 'data-testid="quotas"' in page and "The platform's default plan allows" in page
    assert "Replicas kept warm (min_replicas and pre-warm windows)" in page


def test_staff_change_plans_in_the_django_admin_and_each_change_is_audited(org):
    staff = get_user_model().objects.create_superuser("staff@example.test", "staff@example.test", "pw")
    client = Client()
    sign_in_staff(client, staff)

    created = client.post("/django-admin/controlplane/plan/add/", {
        "name": "team", "max_endpoints": 20, "max_replicas": 16, "max_min_replicas": 4, "max_held_requests": 128,
        "max_file_bytes": 50 * 1024**3, "max_gpus_by_type": '{"h100-80gb": 2}'})
    plan = Plan.objects.get(name="team")
    moved = client.post(f"/django-admin/controlplane/organization/{org.pk}/change/", {"plan": plan.pk})

    assert created.status_code == 302 and moved.status_code == 302
    assert Organization.objects.get(pk=org.pk).quotas.max_gpus("h100-80gb") == 2
    assert Organization.objects.get(pk=org.pk).quotas.max_file_bytes == 50 * 1024**3
    actions = list(AuditEvent.objects.exclude(action__startswith="staff.second_factor.").order_by("created_at")
                   .values_list("action", "actor__username", "organization_id"))
    assert actions == [("plan.create", staff.username, None), ("organization.plan", staff.username, org.pk)]


def test_a_plan_with_malformed_gpu_counts_is_refused_in_the_admin():
    staff = get_user_model().objects.create_superuser("staff@example.test", "staff@example.test", "pw")
    client = Client()
    sign_in_staff(client, staff)

    response = client.post("/django-admin/controlplane/plan/add/", {
        "name": "broken", "max_endpoints": 1, "max_replicas": 1, "max_min_replicas": 0, "max_held_requests": 1,
        "max_file_bytes": 1, "max_gpus_by_type": '["h100-80gb"]'})

    assert response.status_code == 200 and "Map GPU types to counts" in response.content.decode()
    assert not Plan.objects.exists() and not AuditEvent.objects.exclude(action__startswith="staff.second_factor.").exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_creates_never_pass_the_endpoint_quota():
    organization = OrganizationFactory()
    _on_plan(organization, max_endpoints=1)
    barrier = threading.Barrier(4)

    def create(index):
        barrier.wait()
        try:
            services.create_endpoint(SYSTEM, organization, name=f"racer-{index}", gpu_type="l4",
                                     model_source="hf:org/tiny-model")
            return "created"
        except QuotaExceeded:
            return "refused"
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        outcomes = sorted(pool.map(create, range(4)))

    assert outcomes == ["created", "refused", "refused", "refused"]
    assert Endpoint.objects.filter(organization=organization).count() == 1
