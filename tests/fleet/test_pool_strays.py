"""The stray sweep (`endpoints.fleet.pool_strays`): a pool machine whose launch record PostgreSQL lost (a failover to a
replica that was behind, a restore to an earlier point) is terminated after a grace period, and nothing else is.

Before it, nothing listed a pool's machines except to look up launches the database knew: such a machine ran, paid for,
its agent turned away, until someone noticed. The policy's provider is the in-test `RecordingProvider`; the real
`local` and `kubernetes` providers (a process, an API server that pages) run at the end."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection
from django.db.models import F
from django.utils import timezone

from controlplane import local_agents
from controlplane.accounts.models import AuditEvent
from endpoints.fleet import pool_strays
from endpoints.fleet.providers import get_provider, pool_spec
from endpoints.fleet.providers.base import LaunchSpec, Machine, ProviderError, ProviderUnreachable
from endpoints.nodes.models import FleetInstallation, LaunchState, NodeLaunch, StrayMachine
from tests.fleet.test_pool_policy import RecordingProvider, make_pool, tick
from tests.fleet.test_provider_kubernetes import api_server  # noqa: F401 - the fixture

STRAY_AUDIT = "node_launch.stray_terminate"


class ListingProvider(RecordingProvider):
    """`RecordingProvider` whose machines carry this fleet's marking, whose list can fail, and whose terminate can."""

    def __init__(self):
        super().__init__()
        self.list_error: Exception | None = None
        self.terminate_error: Exception | None = None
        self.num_lists = 0

    def launch(self, pool, specs):
        results = super().launch(pool, specs)
        self.machines = {key: dataclasses.replace(machine, fleet_marked=True) for key, machine in self.machines.items()}
        return results

    def list(self, pool):
        self.num_lists += 1
        if self.list_error is not None:
            raise self.list_error
        return super().list(pool)

    def terminate(self, pool, provider_id):
        if self.terminate_error is not None:
            raise self.terminate_error
        super().terminate(pool, provider_id)

    def lose_record(self, *, marked: bool = True, launch_id: str = "") -> Machine:
        """A machine started for a launch whose record PostgreSQL no longer has."""
        launch_id = launch_id or str(uuid.uuid4())
        machine = Machine(f"i-{launch_id[:8]}", launch_id, "running", f"node-{launch_id[:8]}", fleet_marked=marked)
        self.machines[launch_id] = machine
        return machine


def sweep(provider, **providers) -> list[str]:
    return pool_strays.sweep_stray_machines(provider_for=lambda name: providers.get(name, provider))


def past_the_grace() -> None:
    """Every stray was first seen a grace period (and a second) ago, by PostgreSQL's clock."""
    StrayMachine.objects.update(first_seen_at=F("first_seen_at") - timedelta(seconds=pool_strays.STRAY_GRACE_S + 1))


def stray_audits() -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=STRAY_AUDIT))


@pytest.mark.django_db
def test_a_machine_whose_launch_record_was_lost_is_terminated_after_the_grace_and_audited():
    pool, provider = make_pool(min_nodes=1), ListingProvider()
    assert tick(provider) == 1  # a recorded machine, running beside the lost one
    lost = provider.lose_record()

    assert sweep(provider) == []  # first seen now: inside the grace
    assert provider.terminated == [] and stray_audits() == []
    [stray] = StrayMachine.objects.all()
    assert (stray.pool_id, stray.provider_id, stray.launch_id) == (pool.pk, lost.provider_id, lost.launch_id)

    past_the_grace()
    assert sweep(provider) == [lost.provider_id]
    assert provider.terminated == [lost.provider_id]
    [launch] = NodeLaunch.objects.filter(pool=pool)
    assert list(provider.machines) == [str(launch.pk)]  # the recorded one runs on
    [audit] = stray_audits()
    assert audit.details["pool"] == pool.name and audit.details["launch_id"] == lost.launch_id
    assert audit.details["provider_id"] == lost.provider_id and "no launch record" in audit.details["reason"]

    assert sweep(provider) == [] and provider.terminated == [lost.provider_id]  # gone: forgotten
    assert StrayMachine.objects.count() == 0 and len(stray_audits()) == 1


@pytest.mark.django_db
def test_a_recorded_machine_one_inside_the_grace_and_one_without_the_fleets_marking_are_never_terminated():
    pool, provider = make_pool(min_nodes=1), ListingProvider()
    tick(provider)
    [launch] = NodeLaunch.objects.filter(pool=pool)
    finished = NodeLaunch.objects.create(pool=pool, state=LaunchState.TERMINATED, deadline_at=launch.deadline_at)
    provider.lose_record(launch_id=str(finished.pk))  # recorded, in any state: the pool's other steps own it
    provider.lose_record(marked=False)  # another fleet's, or launched before the marking existed
    provider.lose_record(launch_id="i-was-not-launched-by-a-pool")  # our marking, but no launch id we make
    for _ in range(3):
        sweep(provider)
        past_the_grace()
    late = provider.lose_record()  # appears now: inside its grace, whatever the others' age
    assert sweep(provider) == []
    assert provider.terminated == [] and stray_audits() == []
    assert list(StrayMachine.objects.values_list("provider_id", flat=True)) == [late.provider_id]


@pytest.mark.django_db
def test_a_stray_whose_record_turns_up_is_forgotten_and_never_terminated():
    pool, provider = make_pool(), ListingProvider()
    lost = provider.lose_record()
    sweep(provider)
    past_the_grace()
    NodeLaunch.objects.create(id=uuid.UUID(lost.launch_id), pool=pool, deadline_at=StrayMachine.objects.get().first_seen_at)
    assert sweep(provider) == [] and provider.terminated == [] and StrayMachine.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("error", [
    ProviderUnreachable("EC2 did not answer a listing: Read timeout on endpoint URL"),
    ProviderError("Kubernetes refused to list pods (410): the continue token expired"),
    TimeoutError("the listing hung past the task's soft time limit"),
])
def test_a_failing_list_terminates_nothing_forgets_nothing_and_stops_no_other_pool(error):
    pool, provider = make_pool(), ListingProvider()
    other_pool, other = make_pool(name="ec2-pool", provider="ec2"), ListingProvider()
    lost, other_lost = provider.lose_record(), other.lose_record()
    sweep(provider, ec2=other)
    past_the_grace()
    first_seen = StrayMachine.objects.get(pool=pool).first_seen_at

    provider.list_error = error
    assert sweep(provider, ec2=other) == [other_lost.provider_id]  # the other pool's sweep goes on
    assert provider.terminated == [] and provider.num_lists == 2
    assert StrayMachine.objects.get(pool=pool).first_seen_at == first_seen  # its grace is not started again

    provider.list_error = None
    assert sweep(provider, ec2=other) == [lost.provider_id]
    assert sorted(audit.details["pool"] for audit in stray_audits()) == sorted([pool.name, other_pool.name])


@pytest.mark.django_db
def test_a_termination_that_fails_is_tried_again_by_the_next_sweep_and_audited_once():
    make_pool()
    provider = ListingProvider()
    lost = provider.lose_record()
    sweep(provider)
    past_the_grace()
    provider.terminate_error = ProviderUnreachable("EC2 is unreachable: Connect timeout")
    assert sweep(provider) == [] and stray_audits() == []
    provider.terminate_error = None
    assert sweep(provider) == [lost.provider_id] and len(stray_audits()) == 1


@pytest.mark.django_db(transaction=True)
def test_two_sweeps_at_once_terminate_and_audit_a_stray_once():
    """Two beats in a rolling deploy: both list the stray before either claims it."""
    make_pool()
    provider = ListingProvider()
    lost = provider.lose_record()
    sweep(provider)
    past_the_grace()
    both_listed = threading.Barrier(2, timeout=10)
    listed = provider.list

    def list_together(pool):
        machines = listed(pool)
        both_listed.wait()
        return machines

    provider.list = list_together
    results, errors = [], []

    def run():
        try:
            results.append(sweep(provider))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and sorted(results) == [[], [lost.provider_id]]
    assert provider.terminated == [lost.provider_id] and len(stray_audits()) == 1


@pytest.mark.django_db
def test_the_local_providers_agent_whose_launch_record_was_lost_is_stopped_and_an_unmarked_one_is_not(settings, tmp_path):
    settings.LOCAL_POOL_DIR = str(tmp_path)
    pool = make_pool()
    agents, processes = {}, []
    markings = {
        "ours": (settings.FLEET_ID, FleetInstallation.current_id()),
        "before its fleet was kept": ("", ""),
        "before its installation was kept": (settings.FLEET_ID, ""),
        "another installation's, sharing the folder": (settings.FLEET_ID, str(uuid.uuid4())),
    }
    for kind, (fleet_id, installation_id) in markings.items():
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        threading.Thread(target=process.wait, daemon=True).start()
        processes.append(process)
        launch_id = str(uuid.uuid4())
        local_agents.LocalAgent(launch_id=launch_id, pool_id=pool.pk, name=f"cpu-pool-{launch_id[:8]}", pid=process.pid,
                                pgid=process.pid, started=local_agents.process_start_time(process.pid),
                                engine_port_min=10000, engine_port_max=10099, fleet_id=fleet_id,
                                installation_id=installation_id).save(tmp_path)
        agents[kind] = (launch_id, process)
    try:
        sweep(get_provider("local"))
        past_the_grace()
        lost_id, lost = agents.pop("ours")
        assert sweep(get_provider("local")) == [lost_id]
        lost.wait(timeout=15)
        assert not local_agents.state_path(tmp_path, lost_id).exists() and len(stray_audits()) == 1
        assert all(process.poll() is None for _, process in agents.values())
    finally:
        for process in processes:
            process.kill()


@pytest.mark.django_db
def test_a_kubernetes_stray_on_a_later_page_is_found_and_a_page_that_fails_terminates_nothing(api_server):  # noqa: F811
    pool = make_pool(name="k8s-pool", provider="kubernetes")
    provider = get_provider("kubernetes")
    recorded = NodeLaunch.objects.create(pool=pool, state=LaunchState.LAUNCHING, deadline_at=timezone.now())
    lost_id = str(uuid.uuid4())
    specs = [LaunchSpec(launch_id=str(launch_id), name="", join_token="jt_unused", control_plane_url="https://x")
             for launch_id in (recorded.pk, lost_id)]
    provider.launch(pool_spec(pool), specs)
    api_server.page_size = 1  # each pod on its own page: the stray is on the second
    lost_pod = f"inferplane-capacity-{lost_id}"

    assert sweep(provider) == []  # found on the second page, inside its grace
    assert list(StrayMachine.objects.values_list("provider_id", flat=True)) == [lost_pod]
    past_the_grace()
    api_server.fail_continued_pages = True  # the continue token expired (410): the first page alone is no list
    assert sweep(provider) == [] and set(api_server.pods) == {f"inferplane-capacity-{recorded.pk}", lost_pod}
    api_server.fail_continued_pages = False
    assert sweep(provider) == [lost_pod] and set(api_server.pods) == {f"inferplane-capacity-{recorded.pk}"}


@pytest.mark.django_db
def test_a_termination_whose_answer_is_lost_is_audited_once_when_its_machine_is_gone():
    """Before, the claim was given back and the next sweep, no longer listing the machine, deleted its row: a machine
    the sweep destroyed with no `node_launch.stray_terminate` audit and no WARNING."""
    make_pool()
    provider = ListingProvider()
    lost = provider.lose_record()
    sweep(provider)
    past_the_grace()
    real_terminate = provider.terminate

    def terminate_then_time_out(pool, provider_id):
        real_terminate(pool, provider_id)  # the provider did it ...
        raise ProviderUnreachable("Kubernetes API read timeout")  # ... but the answer was lost

    provider.terminate = terminate_then_time_out
    assert sweep(provider) == [] and provider.terminated == [lost.provider_id]
    assert stray_audits() == []  # not known yet: the machine may still be there
    provider.terminate = real_terminate
    sweep(provider)  # the machine is gone
    sweep(provider)
    assert not StrayMachine.objects.exists()
    [audit] = stray_audits()
    assert audit.details["provider_id"] == lost.provider_id and "answer to its termination was lost" in \
        audit.details["reason"]


@pytest.mark.django_db
def test_a_refused_termination_of_a_machine_that_goes_later_is_not_audited_as_the_sweeps():
    make_pool()
    provider = ListingProvider()
    lost = provider.lose_record()
    sweep(provider)
    past_the_grace()
    provider.terminate_error = ProviderError("EC2 refused (UnauthorizedOperation): not allowed")
    assert sweep(provider) == []
    del provider.machines[lost.launch_id]  # an operator terminated it by hand
    sweep(provider)
    assert not StrayMachine.objects.exists() and stray_audits() == []


@pytest.mark.django_db
def test_celerys_soft_time_limit_ends_the_sweep_instead_of_being_logged_as_one_pools_failure():
    """Before, `SoftTimeLimitExceeded` was caught with the per-pool errors: the sweep went on into the other pools until
    the hard kill."""
    make_pool()
    make_pool(name="ec2-pool", provider="ec2")
    provider, other = ListingProvider(), ListingProvider()
    provider.list_error = SoftTimeLimitExceeded()
    with pytest.raises(SoftTimeLimitExceeded):
        sweep(provider, ec2=other)
    assert other.num_lists == 0


@pytest.mark.django_db
def test_a_pool_whose_listing_outlasts_the_sweep_does_not_keep_the_other_pools_strays_running():
    # NOTE: the sweep took the pools in the order of their ids, and its time limit (or the hard kill) ends it inside a
    # provider's call: a first pool whose listing outlasted it (an API that hangs, retried) had every sweep end there,
    # and the strays of the pools after it were never terminated, paid for. As the node pools' tick, the pool whose
    # turn started least recently goes first.
    make_pool(name="a-slow", provider="ec2")
    make_pool(name="b-other")
    slow, fine = ListingProvider(), ListingProvider()
    slow.list_error = SoftTimeLimitExceeded()
    lost = fine.lose_record()
    for _ in range(2):  # each pool's turn comes every other sweep: the slow one's, then the other's first
        with pytest.raises(SoftTimeLimitExceeded):
            sweep(fine, ec2=slow)
    assert fine.num_lists == 1
    past_the_grace()
    for _ in range(2):
        with pytest.raises(SoftTimeLimitExceeded):
            sweep(fine, ec2=slow)
    assert fine.terminated == [lost.provider_id]
