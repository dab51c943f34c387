"""Lock order on an endpoint's row and its replicas' rows: a heartbeat's report of a replica, the start-timeout sweep
(`fail_replica_and_count`), a reconcile's scale-down, an engine-restarting edit and the silent-node sweep never
deadlock, and a failure a heartbeat reports is counted before any reconcile can replace its replica.

Before: a heartbeat's report (`apply_replica_report`) took `SELECT ... FOR UPDATE` over replica JOIN endpoint, which
PostgreSQL locks row by row, the replica's first, while the sweep, a reconcile and an edit hold the endpoint's row and
then write the replica; and a plain `FOR UPDATE` on the endpoint blocked the `FOR KEY SHARE` an event's deferred
foreign key takes at commit. Each test saw `deadlock detected`: the heartbeat a 500, the edit a 500 with its change
lost, or the sweep's pass aborted (a silent node not taken offline). Every test runs real transactions on connections
of their own, one of them paused while it holds its locks."""
import threading
import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane import tasks as controlplane_tasks
from controlplane.accounts.models import Role, lock_organizations
from controlplane.accounts.services import SYSTEM, Actor
from controlplane.accounts.tenancy import SESSION_KEY
from endpoints import autoscaler, scheduler, services
from endpoints import quotas as endpoint_quotas
from endpoints import replicas as replicas_module
from endpoints.autoscaler import Load
from endpoints.fleet.services import create_join_token
from endpoints.models import Endpoint, Replica
from endpoints.nodes.models import Node
from endpoints.replicas import apply_replica_report
from gpu_agent.protocol import ReplicaState, ReplicaStatus
from tests.factories import EndpointFactory, MembershipFactory, UserFactory, make_credential
from tests.processes import wait_until
from tests.test_agent_api import beat, register
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db(transaction=True)

ADDRESS = "http://127.0.0.1:20001"


def _paused(real, go: threading.Event, *, before: bool, seconds: float = 0.5):
    """`real`, which pauses once, where its caller holds its locks: before calling it or after, `go` set."""
    def paused(*args, **kwargs):
        if before and not go.is_set():
            go.set()
            time.sleep(seconds)
        result = real(*args, **kwargs)
        if not before and not go.is_set():
            go.set()
            time.sleep(seconds)
        return result
    return paused


def _together(works: dict, *, first: str, go: threading.Event) -> dict[str, str]:
    """Runs each work in a thread with a database connection of its own: `first` at once, the others once `go` is set
    (by `first`, paused holding its locks). Returns the errors each raised, by name."""
    errors = {}

    def run(name, work):
        try:
            if name != first:
                go.wait(10)
            work()
        except Exception as exc:  # noqa: BLE001
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=item) for item in works.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert go.is_set() and not any(thread.is_alive() for thread in threads)
    return errors


def _num_waiting_on_locks() -> int:
    """How many of the test database's sessions wait for a lock now."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # NOTE: else, in a transaction, its first read's answer
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()")
        return cursor.fetchone()[0]


@pytest.fixture(autouse=True)
def _no_task_messages(monkeypatch):
    monkeypatch.setattr(controlplane_tasks.current_app, "send_task", lambda name, **kwargs: None)


def _reconcile(endpoint, load: Load | None = None):
    """A reconcile of the endpoint with `load`; by default idle for two hours, which scales it down."""
    return lambda: scheduler.reconcile_endpoint(str(endpoint.pk), load or Load(0, 0, timezone.now().timestamp() - 7200, 0))


def _serving_replica(endpoint, node) -> Replica:
    return Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address=ADDRESS,
                                  ready_at=timezone.now() - timedelta(hours=1))


def test_the_start_timeout_sweep_and_the_replicas_heartbeat_do_not_deadlock(monkeypatch):
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    Replica.objects.filter(pk=replica.pk).update(
        created_at=timezone.now() - timedelta(seconds=settings.REPLICA_START_TIMEOUT_S + 60))
    go = threading.Event()
    # `fail_replica_and_count` holds the endpoint's row
    monkeypatch.setattr(replicas_module, "fail_replica", _paused(replicas_module.fail_replica, go, before=True))

    errors = _together({
        "sweep": scheduler._sweep,
        "heartbeat": lambda: apply_replica_report(node, ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.STARTING, progress="loading weights 99%")),
    }, first="sweep", go=go)

    assert errors == {}


def test_a_reconciles_scale_down_and_the_replicas_heartbeat_do_not_deadlock(monkeypatch):
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = _serving_replica(endpoint, node)
    go = threading.Event()
    monkeypatch.setattr(autoscaler, "decide", _paused(autoscaler.decide, go, before=True))  # the endpoint's row held

    errors = _together({
        "reconcile": _reconcile(endpoint),
        "heartbeat": lambda: apply_replica_report(node, ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.READY, address=ADDRESS, num_running=0)),
    }, first="reconcile", go=go)

    assert errors == {}


def test_a_reconciles_scale_down_and_the_sweep_taking_its_node_offline_do_not_deadlock(monkeypatch):
    # The sweep's one transaction writes the replica, then its event's deferred foreign key takes FOR KEY SHARE on the
    # endpoint at commit, which a plain FOR UPDATE held by the reconcile blocked.
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    make_node(memory_mb=80_000)  # the fleet is not silent as a whole
    _serving_replica(endpoint, node)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(hours=1))
    go = threading.Event()
    monkeypatch.setattr(autoscaler, "decide", _paused(autoscaler.decide, go, before=True))

    errors = _together({"reconcile": _reconcile(endpoint), "sweep": scheduler._sweep}, first="reconcile", go=go)

    assert errors == {}


def test_an_engine_restarting_edit_and_a_heartbeat_reporting_a_restart_do_not_deadlock(monkeypatch):
    """Before: the edit (`services.update_endpoint`, a plain FOR UPDATE on the endpoint, then `drain_replicas`) was the
    deadlock's victim: a 500 to the user fixing a crash-looping engine, and the change not saved."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=0, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = _serving_replica(endpoint, node)
    go = threading.Event()
    # the heartbeat's restart event written: the replica's row is locked
    monkeypatch.setattr(replicas_module, "record_event",
                        _paused(replicas_module.record_event, go, before=False, seconds=1.0))

    errors = _together({
        "heartbeat": lambda: apply_replica_report(node, ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.READY, address=ADDRESS, num_restarts=1,
            failure_reason="CUDA error: out of memory")),
        "edit": lambda: services.update_endpoint(Actor(), Endpoint.objects.get(pk=endpoint.pk), max_num_seqs=32),
    }, first="heartbeat", go=go)

    assert errors == {}


def test_a_heartbeat_reported_failure_is_counted_before_any_reconcile_can_replace_it(monkeypatch):
    """Before: the report committed the replica FAILED and counted its failure only afterwards
    (`_announce_transition`): a worker's reconcile in between (the periodic pass, a waiting call's request) saw no
    replica and no backoff and placed a replacement at once (placed 1, `next_attempt_at` None). A review's finding."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=1)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.STARTING)
    real_record_event, seen = replicas_module.record_event, {}

    def a_workers_reconcile():  # its own connection, as a worker's
        try:
            _reconcile(endpoint, Load(0, 0, timezone.now().timestamp(), 0))()
            seen["placed"] = Replica.objects.filter(endpoint=endpoint).exclude(pk=replica.pk).count()
        finally:
            connection.close()

    def record_event(endpoint_, kind, message, **kwargs):
        real_record_event(endpoint_, kind, message, **kwargs)
        if "failed:" in message and "placed" not in seen:  # the report's FAILED event: the replica written FAILED
            worker = threading.Thread(target=a_workers_reconcile)
            worker.start()
            worker.join(10)

    monkeypatch.setattr(replicas_module, "record_event", record_event)
    apply_replica_report(node, ReplicaStatus(replica_id=str(replica.pk), state=ReplicaState.FAILED,
                                             failure_reason="RuntimeError: CUDA error: out of memory"))
    endpoint.refresh_from_db()
    assert endpoint.next_attempt_at is not None and endpoint.num_failures_since_ready == 1
    assert seen == {"placed": 0}
    assert Replica.objects.filter(endpoint=endpoint).exclude(pk=replica.pk).count() == 0


@pytest.mark.parametrize("first", ["heartbeat", "reconcile", "edit"])
def test_a_failed_report_a_reconcile_and_an_engine_restarting_edit_do_not_deadlock(monkeypatch, first):
    """A report that fails its replica locks its endpoint's row (FOR NO KEY UPDATE), then its replica's, and counts the
    failure in that transaction: whichever of the three holds the endpoint's row first, the others wait or skip it."""
    endpoint = EndpointFactory(gpu_type="l4", min_replicas=1, max_replicas=2)
    node = make_node(memory_mb=80_000)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY, address=ADDRESS,
                                     ready_at=timezone.now())
    go, paused = threading.Event(), threading.Event()  # `paused`: a go the other two never wait on
    for who, owner, name in (("heartbeat", replicas_module, "record_event"), ("reconcile", autoscaler, "decide"),
                             ("edit", services, "drain_replicas")):
        # it holds the endpoint's row (and, the heartbeat, its replica's) once it has written this
        monkeypatch.setattr(owner, name, _paused(getattr(owner, name), go if who == first else paused, before=False))
    paused.set()

    errors = _together({
        "heartbeat": lambda: apply_replica_report(node, ReplicaStatus(
            replica_id=str(replica.pk), state=ReplicaState.FAILED, address=ADDRESS,
            failure_reason="RuntimeError: CUDA error: out of memory")),
        "reconcile": _reconcile(endpoint, Load(0, 8, timezone.now().timestamp(), 8)),
        "edit": lambda: services.update_endpoint(Actor(), Endpoint.objects.get(pk=endpoint.pk), max_num_seqs=32),
    }, first=first, go=go)

    assert errors == {}
    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED


# How long the organisation's row is held at most (a key revocation walking thousands of minted keys held it 12 s); a
# heartbeat's agent gives up at 10 s (its `request_timeout_s`) and backs off.
# NOTE: the hold ends as soon as the call timed under it has its answer: one that waits for the row is answered only
# when the hold ends, ORGANIZATION_HELD_S after it began (past the 1.5 s the tests allow), while one that does not wait
# answers at once and is not made to sit out the rest (each of these tests waited the whole 4 s before).
ORGANIZATION_HELD_S = 4.0


def _while_the_organisation_is_held(endpoint, waiter, heartbeat, monkeypatch) -> dict:
    """Holds the endpoint's organisation's row as a key revocation does, for `ORGANIZATION_HELD_S`; meanwhile `waiter`
    (a reconcile task, an edit) reaches the endpoint's row (`autoscaler.decide`, `quotas.check_spec`: called once it
    holds it, if it takes it) and waits for the organisation's; then `heartbeat()`, whose answer and seconds are
    returned with the errors each raised."""
    held, waiting, answered = threading.Event(), threading.Event(), threading.Event()
    for owner, name in ((autoscaler, "decide"), (services.quotas, "lock_organization")):
        monkeypatch.setattr(owner, name, _paused(getattr(owner, name), waiting, before=name == "lock_organization",
                                                 seconds=0))
    outcome = {"errors": {}}

    def run(name, work, after=None):
        try:
            if after is not None:
                after.wait(10)
                time.sleep(0.3)  # the waiter is now queued on the organisation's row
            work()
        except Exception as exc:  # noqa: BLE001
            outcome["errors"][name] = repr(exc)[:300]
        finally:
            connection.close()

    def hold():
        with transaction.atomic():
            lock_organizations([endpoint.organization_id])
            held.set()
            answered.wait(ORGANIZATION_HELD_S)

    def timed_heartbeat():
        started = time.monotonic()
        try:
            outcome["answer"] = heartbeat()
            outcome["seconds"] = time.monotonic() - started
        finally:
            answered.set()

    threads = [threading.Thread(target=run, args=("revocation", hold)),
               threading.Thread(target=run, args=("waiter", waiter, held)),
               threading.Thread(target=run, args=("heartbeat", timed_heartbeat, waiting))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return outcome


@pytest.mark.parametrize("report", [ReplicaState.FAILED, ReplicaState.READY])
def test_a_nodes_heartbeat_is_answered_at_once_while_a_reconcile_task_waits_for_its_organisations_row(
        monkeypatch, report):
    """Before: the endpoint's own reconcile task (a wake, a spec change) held the endpoint's row while it waited for
    its organisation's, held by a key revocation; a heartbeat reporting a replica of it failed, or READY (its counts
    cleared under the endpoint's row), waited behind both: the whole node's heartbeat, every tenant's replicas in it,
    answered after the revocation, past the agent's timeout for a long one, and the node taken OFFLINE after a few.
    Nothing the reconcile was to do is lost: it places its replica once the organisation's row is free."""
    client = Client()
    agent = register(client, create_join_token(SYSTEM, name="test").plain).json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=2, max_replicas=2, model_source="/models/tiny")
    replica = Replica.objects.create(
        endpoint=endpoint, node_id=agent["node_id"],
        state=ReplicaState.READY if report == ReplicaState.FAILED else ReplicaState.STARTING)
    status = (ReplicaStatus(str(replica.pk), ReplicaState.FAILED, failure_reason="RuntimeError: CUDA error")
              if report == ReplicaState.FAILED else ReplicaStatus(str(replica.pk), ReplicaState.READY,
                                                                   address="http://127.0.0.1:20000"))

    outcome = _while_the_organisation_is_held(
        endpoint, lambda: scheduler.reconcile_endpoint(str(endpoint.pk)),
        lambda: beat(Client(), agent["node_secret"], [status]), monkeypatch)

    assert outcome["errors"] == {}
    assert outcome["answer"].status_code == 200 and outcome["seconds"] < 1.5
    replica.refresh_from_db()
    assert replica.state == report
    if report == ReplicaState.READY:  # the reconcile went on once the row was free: its scale-up placed
        assert Replica.objects.filter(endpoint=endpoint, state=ReplicaState.PENDING).count() == 1


def test_a_nodes_heartbeat_is_answered_at_once_while_an_edit_waits_for_its_organisations_row(
        monkeypatch, member_client_factory):
    """Before: an edit of an endpoint (`PATCH /api/v1/endpoints/<id>/`) locked the endpoint's row, then waited for its
    organisation's (its quotas checked under it), held by a key revocation: a heartbeat reporting a replica of that
    endpoint failed waited behind both, the node's whole heartbeat with it. The edit itself is saved once the row is
    free."""
    client = Client()
    agent = register(client, create_join_token(SYSTEM, name="test").plain).json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=1, max_replicas=1, model_source="/models/tiny")
    replica = Replica.objects.create(endpoint=endpoint, node_id=agent["node_id"], state=ReplicaState.READY)
    owner = member_client_factory(endpoint.organization)
    edited = {}

    def edit():
        edited["answer"] = owner.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"max_num_seqs": 32}, format="json")

    outcome = _while_the_organisation_is_held(endpoint, edit, lambda: beat(Client(), agent["node_secret"], [
        ReplicaStatus(str(replica.pk), ReplicaState.FAILED, failure_reason="RuntimeError: CUDA error")]), monkeypatch)

    assert outcome["errors"] == {}
    assert outcome["answer"].status_code == 200 and outcome["seconds"] < 1.5
    assert edited["answer"].status_code == 200, edited["answer"].content
    endpoint.refresh_from_db()
    replica.refresh_from_db()
    assert endpoint.max_num_seqs == 32 and replica.state == ReplicaState.FAILED


def _console_owner(endpoint) -> Client:
    """A client logged in to the console as an owner of the endpoint's organisation."""
    owner = Client()
    user = UserFactory()
    MembershipFactory(organization=endpoint.organization, user=user, role=Role.OWNER)
    owner.force_login(user)
    session = owner.session
    session[SESSION_KEY] = endpoint.organization_id
    session.save()
    return owner


def _console_spec(endpoint, *, max_num_seqs: int) -> dict:
    """The console's edit form for the endpoint, `max_num_seqs` changed."""
    return {"name": endpoint.name, "model_source": endpoint.model_source, "gpu_type": endpoint.gpu_type,
            "quantization": endpoint.quantization, "min_replicas": "0", "max_replicas": "1", "idle_timeout_s": "300",
            "target_concurrency": "8", "max_num_seqs": str(max_num_seqs), "cold_start_timeout_s": "300",
            "gpus_per_replica": "", "idle_action": "stop"}


def test_a_nodes_heartbeat_is_answered_at_once_while_a_console_edit_waits_for_its_organisations_row(monkeypatch):
    """The console's edit of an endpoint takes its organisation's row before the endpoint's, as the API's does: before,
    it locked the endpoint's row and then waited for its organisation's (`services.update_endpoint`), and a heartbeat
    reporting a replica of it failed waited behind both. The edit itself is saved once the row is free."""
    client = Client()
    agent = register(client, create_join_token(SYSTEM, name="test").plain).json()
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=0, max_replicas=1, model_source="/models/tiny")
    replica = Replica.objects.create(endpoint=endpoint, node_id=agent["node_id"], state=ReplicaState.READY)
    owner = _console_owner(endpoint)
    spec = _console_spec(endpoint, max_num_seqs=32)
    edited = {}

    def edit():
        edited["answer"] = owner.post(reverse("console:endpoint-edit", args=[endpoint.pk]), spec)

    outcome = _while_the_organisation_is_held(endpoint, edit, lambda: beat(Client(), agent["node_secret"], [
        ReplicaStatus(str(replica.pk), ReplicaState.FAILED, failure_reason="RuntimeError: CUDA error")]), monkeypatch)

    assert outcome["errors"] == {}
    assert outcome["answer"].status_code == 200 and outcome["seconds"] < 1.5
    assert edited["answer"].status_code == 302, edited["answer"].content.decode()[-2000:]
    endpoint.refresh_from_db()
    replica.refresh_from_db()
    assert endpoint.max_num_seqs == 32 and replica.state == ReplicaState.FAILED


def test_a_credentials_edit_does_not_wait_for_its_organisations_row(member_client_factory):
    """A credential's edit (`PATCH /api/v1/credentials/<id>/`) locks no endpoint nor counts a quota: it has no use for
    its organisation's row. Before, it waited for it (a copy of the endpoint edit's order) behind a key revocation, the
    seconds it took, and held it meanwhile from every scale-up of that organisation."""
    organization = EndpointFactory().organization
    credential = make_credential(organization)
    owner = member_client_factory(organization)
    held, answered, answer = threading.Event(), threading.Event(), {}

    def hold():
        with transaction.atomic():
            lock_organizations([organization.pk])
            held.set()
            answered.wait(ORGANIZATION_HELD_S)
        connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        answer["patch"] = owner.patch(f"/api/v1/credentials/{credential.pk}/", {"region": "us-east-1"}, format="json")
        answer["seconds"] = time.monotonic() - started
    finally:
        answered.set()
        holder.join(30)
    assert answer["patch"].status_code == 200, answer["patch"].content
    assert answer["seconds"] < 1.5
    credential.refresh_from_db()
    assert credential.region == "us-east-1"


@pytest.mark.parametrize("where", ["api", "console"])
def test_an_edit_caught_in_a_deadlock_with_a_pod_of_the_release_before_is_saved_not_answered_500(
        monkeypatch, member_client_factory, where):
    """An edit takes its organisation's row before its endpoint's; a pod of the release before (its edit, its reconcile
    task) took the endpoint's first, then waited for the organisation's. During a rollout the two deadlocked and
    PostgreSQL broke it, rolling the edit back: a 500 for a valid edit. The edit now runs once more, and is saved."""
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=0, max_replicas=1, model_source="/models/tiny")
    endpoint_held, organization_held = threading.Event(), threading.Event()
    # The edit has its organisation's row once `lock_organization` returns (the API's and the console's alike).
    monkeypatch.setattr(endpoint_quotas, "lock_organization",
                        _paused(endpoint_quotas.lock_organization, organization_held, before=False, seconds=0))
    edited = {}

    def old_pod():  # the release before's order: the endpoint's row, then the organisation's
        with transaction.atomic():
            Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint.pk).values_list("pk").first()
            endpoint_held.set()
            organization_held.wait(10)
            time.sleep(0.3)  # the edit now waits for the endpoint's row
            lock_organizations([endpoint.organization_id])

    def edit():
        endpoint_held.wait(10)
        if where == "api":
            owner = member_client_factory(endpoint.organization)
            edited["answer"] = owner.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"max_num_seqs": 32}, format="json")
        else:
            edited["answer"] = _console_owner(endpoint).post(
                reverse("console:endpoint-edit", args=[endpoint.pk]), _console_spec(endpoint, max_num_seqs=32))

    errors = _together({"old pod": old_pod, "edit": edit}, first="old pod", go=endpoint_held)

    assert errors == {}
    assert edited["answer"].status_code == (200 if where == "api" else 302)
    endpoint.refresh_from_db()
    assert endpoint.max_num_seqs == 32


def test_an_edit_caught_in_a_second_deadlock_with_pods_of_the_release_before_is_saved_not_answered_500(
        monkeypatch, member_client_factory):
    """Run again after a deadlock, an edit waited for its endpoint's row and took its organisation's back: another pod
    of the release before (its next reconcile task) taking the endpoint's row meanwhile deadlocked with it once more,
    and the edit, PostgreSQL's victim again, was answered 500. It runs again after each deadlock, up to a bound."""
    endpoint = EndpointFactory(gpu_type="cpu", min_replicas=0, max_replicas=1, model_source="/models/tiny")
    endpoint_held, organization_held = threading.Event(), threading.Event()
    monkeypatch.setattr(endpoint_quotas, "lock_organization",
                        _paused(endpoint_quotas.lock_organization, organization_held, before=False, seconds=0))
    waited, second_holds = threading.Event(), threading.Event()
    real_wait = services.wait_for_endpoint_row

    def wait_for_endpoint_row(endpoint_id):  # the edit waited for the first pod; the second takes the row next
        real_wait(endpoint_id)
        if not waited.is_set():
            waited.set()
            second_holds.wait(10)

    monkeypatch.setattr(services, "wait_for_endpoint_row", wait_for_endpoint_row)
    edited = {}

    def old_pod(after: threading.Event, holds: threading.Event):  # the release before's order: endpoint, organisation
        after.wait(10)
        with transaction.atomic():
            Endpoint.objects.select_for_update(no_key=True).filter(pk=endpoint.pk).values_list("pk").first()
            holds.set()
            organization_held.wait(10)
            wait_until(lambda: _num_waiting_on_locks() >= 1, 10, message="the edit to wait for the endpoint's row")
            lock_organizations([endpoint.organization_id])

    def edit():
        endpoint_held.wait(10)
        owner = member_client_factory(endpoint.organization)
        edited["answer"] = owner.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"max_num_seqs": 32}, format="json")

    go = threading.Event()
    go.set()
    errors = _together({"first old pod": lambda: old_pod(go, endpoint_held), "edit": edit,
                        "second old pod": lambda: old_pod(waited, second_holds)}, first="first old pod", go=go)

    assert errors == {}
    assert edited["answer"].status_code == 200, edited["answer"].content
    endpoint.refresh_from_db()
    assert endpoint.max_num_seqs == 32
