"""`/api/v1/fleet/pools/`: staff define node pools; everyone else finds nothing there (a 404)."""

import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import AuditEvent, Role, Scope
from controlplane.accounts.services import Actor
from endpoints.catalogue import GPU_TYPES
from endpoints.fleet import launches
from endpoints.fleet.pool_services import create_node_pool
from endpoints.nodes.models import LaunchState, NodeLaunch, NodePool
from tests.factories import MembershipFactory, UserFactory, sign_in_staff
from tests.fleet.staff_schema import staff_schema

pytestmark = pytest.mark.django_db

POOLS = "/api/v1/fleet/pools/"
POOL = {"name": "l4-local", "gpu_type": "l4", "provider": "local", "max_nodes": 3, "warm_nodes": 1,
        "idle_timeout_s": 300, "hourly_price": "2.40"}


@pytest.fixture
def staff_member(org):
    user = UserFactory(is_staff=True)
    MembershipFactory(organization=org, user=user, role=Role.OWNER)
    return user


@pytest.fixture
def staff_client(staff_member):
    client = APIClient()
    sign_in_staff(client, staff_member)  # a staff session, as the console's (it ends after STAFF_SESSION_HOURS)
    client.user = staff_member
    return client


def make_pool(**fields):
    return create_node_pool(Actor(), **(POOL | fields))


def test_staff_create_a_pool_whose_memory_defaults_from_the_catalogue_and_it_is_audited(staff_client):
    response = staff_client.post(POOLS, POOL, format="json")

    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["gpu_memory_mb"] == GPU_TYPES["l4"].memory_mb and body["gpus_per_node"] == 1
    assert (body["num_live"], body["num_booting"], body["usage"]["cost"]) == (0, 0, "0.0000")
    assert NodePool.objects.get(name="l4-local").hourly_price == Decimal("2.40")
    event = AuditEvent.objects.get(action="node_pool.create")
    assert event.actor == staff_client.user and Decimal(event.details["hourly_price"]) == Decimal("2.40")


def test_a_cpu_pool_has_no_gpus_per_machine_by_default(staff_client):
    response = staff_client.post(POOLS, POOL | {"name": "cpu", "gpu_type": "cpu"}, format="json")

    assert response.status_code == 201 and response.json()["gpus_per_node"] == 0


def test_non_staff_and_their_keys_find_no_pools_at_all(owner_client):
    pool = make_pool()

    answers = [owner_client.get(POOLS), owner_client.post(POOLS, POOL | {"name": "mine"}, format="json"),
               owner_client.get(f"{POOLS}{pool.pk}/"), owner_client.patch(f"{POOLS}{pool.pk}/", {"max_nodes": 9}, format="json"),
               owner_client.delete(f"{POOLS}{pool.pk}/")]

    assert [answer.status_code for answer in answers] == [404] * 5
    assert answers[0].json() == {"detail": "Not found."}
    assert NodePool.objects.get().max_nodes == 3 and not NodePool.objects.filter(name="mine").exists()


def test_a_staff_members_api_key_has_no_staff_powers_and_finds_no_pools(org, staff_member):
    """Staff powers come with a staff session alone: a key never expires and the route is on the public ingress."""
    pool = make_pool()
    created = create_api_key(Actor(user=staff_member), org, name="staff", scopes=[Scope.MANAGE])
    keyed = APIClient()
    keyed.credentials(HTTP_AUTHORIZATION=f"Bearer {created.plain}")

    answers = [keyed.get(POOLS), keyed.post(POOLS, POOL | {"name": "mine"}, format="json"),
               keyed.get(f"{POOLS}{pool.pk}/"), keyed.patch(f"{POOLS}{pool.pk}/", {"max_nodes": 9}, format="json"),
               keyed.delete(f"{POOLS}{pool.pk}/")]

    assert [answer.status_code for answer in answers] == [404] * 5
    assert NodePool.objects.get().max_nodes == 3 and not NodePool.objects.filter(name="mine").exists()


def test_a_staff_session_ends_hours_after_its_sign_in(staff_client, settings):
    assert staff_client.session.get_expiry_age() <= settings.STAFF_SESSION_HOURS * 3600


def test_without_credentials_the_pools_are_a_401(client):
    assert APIClient().get(POOLS).status_code == 401


@pytest.mark.parametrize(("change", "field"), [
    ({"gpu_type": "tpu-v5"}, "gpu_type"),
    ({"provider": "gce"}, "provider"),
    ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"min_nodes": 4}, "min_nodes"),
    ({"min_nodes": 2, "warm_nodes": 2}, "warm_nodes"),
    ({"idle_timeout_s": 0}, "idle_timeout_s"),
    ({"join_deadline_s": 0}, "join_deadline_s"),
    ({"hourly_price": "-1"}, "hourly_price"),
    ({"name": "Not A Slug"}, "name"),
    ({"template": ["not", "an", "object"]}, "template"),
    ({"colour": "blue"}, "colour"),
])
def test_a_pool_that_breaks_a_rule_is_a_400_naming_the_field(staff_client, change, field):
    response = staff_client.post(POOLS, POOL | change, format="json")

    assert response.status_code == 400
    assert field in response.json(), response.json()
    assert not NodePool.objects.exists()


def test_a_template_posted_as_form_json_nested_too_deeply_is_a_400_on_the_template(staff_client, settings):
    """A form post's template is JSON text DRF's JSONField parses: `[[[…]]]` 5,000 levels deep raised a
    RecursionError it does not catch (a 500)."""
    settings.DEBUG = False
    staff_client.raise_request_exception = False

    response = staff_client.post(POOLS, POOL | {"template": "[" * 5000 + "]" * 5000})

    assert response.status_code == 400
    assert response.json() == {"template": ["Value must be valid JSON."]}
    assert not NodePool.objects.exists()


def test_the_providers_template_errors_come_back_as_template_fields(staff_client):
    response = staff_client.post(POOLS, POOL | {"template": {"engine_ports": "80-90", "subnet": "x"}}, format="json")

    assert response.status_code == 400
    errors = response.json()
    assert "template.engine_ports" in errors and "template.subnet" in errors


def test_a_second_pool_of_the_same_name_is_refused(staff_client):
    make_pool()

    response = staff_client.post(POOLS, POOL, format="json")

    assert response.status_code == 400 and "exists" in response.json()["name"][0]


def test_staff_list_read_and_change_a_pool_and_the_whole_pool_must_still_be_valid(staff_client):
    pool = make_pool()

    listed = staff_client.get(POOLS).json()
    changed = staff_client.patch(f"{POOLS}{pool.pk}/", {"max_nodes": 5, "min_nodes": 1}, format="json")
    too_small = staff_client.patch(f"{POOLS}{pool.pk}/", {"max_nodes": 1}, format="json")

    assert [row["name"] for row in listed["results"]] == ["l4-local"]
    assert changed.status_code == 200 and (changed.json()["min_nodes"], changed.json()["max_nodes"]) == (1, 5)
    assert too_small.status_code == 400 and "warm_nodes" in too_small.json()  # min 1 + warm 1 > max 1
    assert staff_client.get(f"{POOLS}{pool.pk}/").json()["max_nodes"] == 5
    update = AuditEvent.objects.get(action="node_pool.update")
    assert update.details == {"min_nodes": 1, "max_nodes": 5}


def test_read_only_figures_cannot_be_written(staff_client):
    pool = make_pool()

    response = staff_client.patch(f"{POOLS}{pool.pk}/", {"num_live": 9}, format="json")

    assert response.status_code == 400 and "num_live" in response.json()


def test_a_pool_reports_live_and_booting_machines_and_its_cost_over_a_chosen_period(staff_client):
    pool = make_pool()
    start = timezone.now() - timedelta(hours=2)
    done = NodeLaunch.objects.create(pool=pool, requested_at=start, deadline_at=start + timedelta(minutes=10))
    launches.finish_launch(done, LaunchState.FAILED, "never joined", now=start + timedelta(minutes=30))
    NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now() + timedelta(minutes=5))
    today = timezone.now().date()

    body = staff_client.get(f"{POOLS}{pool.pk}/", {"start": str(today - timedelta(days=1)), "end": str(today)}).json()
    earlier = staff_client.get(f"{POOLS}{pool.pk}/", {"start": "2020-01-01", "end": "2020-01-31"}).json()

    assert (body["num_live"], body["num_booting"]) == (1, 1)
    assert body["usage"]["idle_node_hours"] >= 0.5 and body["usage"]["busy_node_hours"] == 0
    assert Decimal(body["usage"]["idle_cost"]) >= Decimal("1.2000")  # half an hour at 2.40 and the booting one
    assert earlier["usage"]["node_hours"] == 0 and earlier["usage"]["period_start"].startswith("2020-01-01")


def test_a_bad_period_is_a_400(staff_client):
    pool = make_pool()

    assert staff_client.get(f"{POOLS}{pool.pk}/", {"start": "2026-02-01", "end": "2026-01-01"}).status_code == 400
    assert staff_client.get(POOLS, {"start": "yesterday"}).status_code == 400


def test_a_pool_with_live_machines_cannot_be_deleted_one_without_goes_with_its_history(staff_client):
    pool = make_pool()
    launch = NodeLaunch.objects.create(pool=pool, deadline_at=timezone.now() + timedelta(minutes=5))

    refused = staff_client.delete(f"{POOLS}{pool.pk}/")
    launches.finish_launch(launch, LaunchState.FAILED, "never joined")
    deleted = staff_client.delete(f"{POOLS}{pool.pk}/")

    assert refused.status_code == 400 and "live machine" in refused.json()["launches"][0]
    assert deleted.status_code == 204
    assert not NodePool.objects.exists() and not NodeLaunch.objects.exists()
    assert AuditEvent.objects.filter(action="node_pool.delete").count() == 1


def test_the_provider_of_a_pool_with_live_machines_cannot_change(staff_client):
    pool = make_pool()
    NodeLaunch.objects.create(pool=pool, deadline_at=timezone.now() + timedelta(minutes=5))

    response = staff_client.patch(f"{POOLS}{pool.pk}/", {"provider": "kubernetes"}, format="json")

    assert response.status_code == 400 and "provider" in response.json()


def test_the_staff_schema_documents_the_pools_404_for_non_staff():
    paths = staff_schema()["paths"]

    assert set(paths[POOLS]) == {"get", "post"}
    assert set(paths[POOLS + "{id}/"]) == {"get", "patch", "delete"}
    assert "404" in paths[POOLS]["get"]["responses"] and "404" in paths[POOLS]["post"]["responses"]
    assert "400" in paths[POOLS + "{id}/"]["delete"]["responses"]
    assert {str(paths[POOLS][method]["security"]) for method in ("get", "post")} == {"[{'cookieAuth': []}]"}


@pytest.mark.django_db(transaction=True)
def test_editing_a_pool_deleted_meanwhile_is_a_404_and_audits_no_edit(staff_client, monkeypatch):
    """The view found the pool, another staff member deleted it, then the edit updated no row, audited an edit of the
    deleted pool and read it again with `refresh_from_db`: DoesNotExist, a 500."""
    from django.db import connection

    from endpoints.fleet import pool_api
    from endpoints.fleet.pool_services import delete_node_pool

    pool = make_pool()
    looked_up = pool_api.NodePoolViewSet.get_object

    def look_up_then_lose_the_race(view):
        found = looked_up(view)

        def delete():
            try:
                delete_node_pool(Actor(), NodePool.objects.get(pk=found.pk))
            finally:
                connection.close()

        thread = threading.Thread(target=delete)
        thread.start()
        thread.join(20)
        assert not thread.is_alive()
        return found

    monkeypatch.setattr(pool_api.NodePoolViewSet, "get_object", look_up_then_lose_the_race)
    response = staff_client.patch(f"{POOLS}{pool.pk}/", {"max_nodes": 5}, format="json")

    assert response.status_code == 404, response.content
    assert not NodePool.objects.exists()
    assert not AuditEvent.objects.filter(action="node_pool.update").exists()
