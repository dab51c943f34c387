"""Node pools on the fleet page (staff only): the table with this month's cost truth, create and edit
forms (the template as JSON, the provider's errors shown), delete, recent launches; and the admin."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import AuditEvent, Role
from controlplane.accounts.services import Actor
from endpoints.fleet import launches
from endpoints.fleet.pool_costs import Period
from endpoints.fleet.pool_services import create_node_pool
from endpoints.nodes.models import LaunchState, Node, NodeLaunch, NodePool

pytestmark = pytest.mark.django_db

FORM = {"name": "l4-spot", "gpu_type": "l4", "provider": "local", "template": '{"engine_ports": "31000-31099"}',
        "gpus_per_node": "", "gpu_memory_mb": "", "min_nodes": "0", "warm_nodes": "1", "max_nodes": "4",
        "idle_timeout_s": "600", "join_deadline_s": "600", "hourly_price": "2.40"}


@pytest.fixture
def staff(org, console_client_factory):
    return console_client_factory(org, Role.OWNER, is_staff=True)


def make_pool(name="l4-spot", **fields):
    return create_node_pool(Actor(), name=name, gpu_type="l4", provider="local", max_nodes=4,
                            hourly_price=Decimal("2.40"), **fields)


def test_the_fleet_page_lists_pools_with_live_machines_and_this_months_busy_and_idle_cost(staff):
    pool = make_pool(min_nodes=1, warm_nodes=1)
    now = timezone.now()
    start = max(now - timedelta(minutes=40), Period.this_month(now).start)
    launch = NodeLaunch.objects.create(pool=pool, requested_at=start, deadline_at=start + timedelta(minutes=10),
                                       provider_id="pid-4242")
    node = Node.objects.create(name="l4-spot-1", gpu_type="l4", num_gpus=1, gpu_memory_mb=23_034,
                               secret_lookup="l4spot100000", secret_digest="x")
    launches.link_joined_node(node, launch=launch, now=start)
    NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=now + timedelta(minutes=5))

    page = staff.get(reverse("console:fleet")).content.decode()

    assert 'data-testid="pool-l4-spot"' in page and "1 / 1 / 4" in page and "$2.40" in page
    assert "pid-4242" in page and "l4-spot-1" in page and "launching" in page  # recent launches
    assert reverse("console:pool-edit", args=[pool.pk]) in page


def test_staff_create_a_pool_from_the_form_and_it_is_audited(staff):
    response = staff.post(reverse("console:pool-new"), FORM)

    assert response.status_code == 302
    pool = NodePool.objects.get(name="l4-spot")
    assert pool.template == {"engine_ports": "31000-31099"} and pool.gpus_per_node == 1 and pool.gpu_memory_mb == 23_034
    assert AuditEvent.objects.filter(action="node_pool.create", actor=staff.user).exists()


def test_the_form_shows_the_providers_template_errors_and_the_pools_rules(staff):
    bad = FORM | {"template": '{"engine_ports": "80-90", "subnet": "a"}', "min_nodes": "5"}

    response = staff.post(reverse("console:pool-new"), bad)

    page = response.content.decode()
    assert response.status_code == 400
    assert "engine_ports: " in page and "subnet: Unknown field" in page and "Must be at most max_nodes." in page
    assert not NodePool.objects.exists()


def test_a_template_that_is_not_a_json_object_is_shown_as_such(staff):
    response = staff.post(reverse("console:pool-new"), FORM | {"template": "[1, 2"})

    assert response.status_code == 400 and "Not valid JSON" in response.content.decode()


def test_a_template_nested_too_deeply_is_shown_as_not_valid_json(staff):
    """`[[[…]]]` 5,000 levels deep raised a RecursionError past the field's `except ValueError`: a 500."""
    response = staff.post(reverse("console:pool-new"), FORM | {"template": "[" * 5000 + "]" * 5000})

    assert response.status_code == 400 and "Not valid JSON: nested too deeply" in response.content.decode()
    assert not NodePool.objects.exists()


def test_staff_edit_a_pool_and_only_what_changed_is_saved(staff):
    pool = make_pool()
    url = reverse("console:pool-edit", args=[pool.pk])
    form = staff.get(url).content.decode()

    response = staff.post(url, FORM | {"max_nodes": "6", "gpu_memory_mb": str(pool.gpu_memory_mb), "template": "{}"})

    assert "l4-spot" in form and "Delete pool" in form
    assert response.status_code == 302
    pool.refresh_from_db()
    assert pool.max_nodes == 6 and pool.warm_nodes == 1
    assert set(AuditEvent.objects.get(action="node_pool.update").details) == {"max_nodes", "warm_nodes"}


def test_a_pool_with_a_live_machine_is_not_deleted_and_says_why(staff):
    pool = make_pool()
    NodeLaunch.objects.create(pool=pool, deadline_at=timezone.now() + timedelta(minutes=5))

    response = staff.post(reverse("console:pool-delete", args=[pool.pk]), follow=True)

    assert "1 live machine" in response.content.decode()
    assert NodePool.objects.filter(pk=pool.pk).exists()


def test_staff_delete_a_pool_without_machines(staff):
    pool = make_pool()

    response = staff.post(reverse("console:pool-delete", args=[pool.pk]))

    assert response.status_code == 302 and not NodePool.objects.exists()


def test_members_who_are_not_staff_reach_no_pool_page(owner):
    pool = make_pool()

    answers = [owner.get(reverse("console:pool-new")), owner.post(reverse("console:pool-new"), FORM),
               owner.get(reverse("console:pool-edit", args=[pool.pk])),
               owner.post(reverse("console:pool-delete", args=[pool.pk]))]

    assert all(answer.status_code in (403, 404) for answer in answers), [a.status_code for a in answers]
    assert NodePool.objects.count() == 1


def test_the_admin_creates_and_changes_pools_through_the_same_rules(staff, django_user_model):
    staff.user.is_superuser = True
    staff.user.save(update_fields=["is_superuser"])
    add_url = reverse("admin:gpu_agent_nodepool_add")
    fields = FORM | {"template": '{"subnet": "a"}'}

    refused = staff.post(add_url, fields)
    created = staff.post(add_url, FORM)

    assert refused.status_code == 200 and "subnet: Unknown field" in refused.content.decode()
    assert created.status_code == 302, created.content.decode()[:2000]
    pool = NodePool.objects.get(name="l4-spot")
    assert pool.gpu_memory_mb == 23_034 and AuditEvent.objects.filter(action="node_pool.create").exists()
    changed = staff.post(reverse("admin:gpu_agent_nodepool_change", args=[pool.pk]),
                         FORM | {"max_nodes": "8", "gpus_per_node": "1", "gpu_memory_mb": "23034"})
    assert changed.status_code == 302
    pool.refresh_from_db()
    assert pool.max_nodes == 8 and AuditEvent.objects.filter(action="node_pool.update").exists()
