"""What a node keeps of an organisation once no replica of its own wants it: its cached private weights go after a
grace (`WeightsCache.release_unwanted`), the S3 clients of its credentials at once (`weights_access.drop_clients_except`).

Real parts: a real agent loop against the fake control plane, moto's S3 server, fake engines."""

from __future__ import annotations

import json
import os
import threading
import time

from gpu_agent.protocol import ReplicaState, SourceCredentials
from gpu_agent.runtime import weights_access
from gpu_agent.runtime.agent import Agent
from gpu_agent.runtime.config import AgentConfig
from gpu_agent.runtime.supervisor import SupervisorPolicy
from gpu_agent.runtime.weights import WeightsCache
from gpu_agent.runtime.weights_access import SourceAccess, s3_client

from .conftest import make_spec, wait_until
from .test_agent_loop import control_plane, fake_engine_factory, running_agent  # noqa: F401  (fixtures)
from .test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401  (fixtures)
from .test_weights_clients import connections_to, list_with, store  # noqa: F401  (fixtures)


def org_credentials(s3_endpoint: str, secret: str = "secret-of-org-1") -> SourceCredentials:  # noqa: F811
    return SourceCredentials(kind="s3", access_key_id="AKIAORGANISATION0001", secret_access_key=secret,
                             region="us-east-1", endpoint_url=s3_endpoint)


def cached_clients_of(credentials: SourceCredentials) -> list:
    digest = weights_access._credentials_digest(credentials)
    with weights_access._clients_lock:
        return [identity for identity in weights_access._clients if identity[0] == digest]


def reported_sources(control_plane) -> set[str]:  # noqa: F811
    with control_plane.lock:
        beat = control_plane.heartbeats[-1]
    return {status.source for status in beat.weights}


def test_a_deleted_endpoints_private_weights_and_its_credentials_client_leave_the_node(
    control_plane, running_agent, s3, s3_endpoint, tokenizer_not_described,  # noqa: F811
):
    """Before: the private copy stayed on the node's disk for good (the budget never needed its room) and the client
    signed with the deleted credential stayed in the agent's memory."""
    upload_model(s3, "org1-private", "m", num_bytes=50_000, public=False)
    upload_model(s3, "catalogue", "m", num_bytes=50_000)
    credentials = org_credentials(s3_endpoint)
    control_plane.desired = [
        make_spec("r-own", model_source="s3://org1-private/m", credentials=credentials, weights_scope="org-1"),
        make_spec("r-pub", model_source="s3://catalogue/m", endpoint_id="e-pub"),
    ]
    agent, _stop, _thread = running_agent(private_weights_grace_s=0.0)
    wait_until(lambda: control_plane.last_states().get("r-own") == ReplicaState.READY
               and control_plane.last_states().get("r-pub") == ReplicaState.READY, 30)
    [private] = [entry["cache_key"] for entry in agent.weights._index.entries() if entry["scope"] == "org-1"]
    assert (agent.weights.root / private / "model.safetensors").exists() and cached_clients_of(credentials)

    with control_plane.lock:  # the endpoint (then its credential) deleted: its replica is no longer wanted
        control_plane.desired = [make_spec("r-pub", model_source="s3://catalogue/m", endpoint_id="e-pub")]
    wait_until(lambda: not (agent.weights.root / private).exists(), 20)
    wait_until(lambda: reported_sources(control_plane) == {"s3://catalogue/m"}, 10)
    assert not (agent.weights.root / f"{private}.json").exists()
    assert not cached_clients_of(credentials)
    # The shared catalogue copy stays (its replica runs; it would stay under the budget anyway).
    assert control_plane.last_states().get("r-pub") == ReplicaState.READY and agent.weights.num_downloads == 2


def test_a_replica_replaced_by_another_of_its_endpoint_keeps_the_private_copy(
    control_plane, running_agent, s3, s3_endpoint, tokenizer_not_described,  # noqa: F811
):
    """A replacement (another replica id, the same source and scope) in the same answer as the drain: its pull starts
    from the cached copy, which the answer names, however short the grace."""
    upload_model(s3, "org1-replaced", "m", num_bytes=50_000, public=False)
    credentials = org_credentials(s3_endpoint)
    spec = {"model_source": "s3://org1-replaced/m", "credentials": credentials, "weights_scope": "org-1"}
    control_plane.desired = [make_spec("r-old", **spec)]
    agent, _stop, _thread = running_agent(private_weights_grace_s=0.0)
    wait_until(lambda: control_plane.last_states().get("r-old") == ReplicaState.READY, 30)
    with control_plane.lock:
        control_plane.desired = [make_spec("r-new", **spec)]
    wait_until(lambda: control_plane.last_states().get("r-new") == ReplicaState.READY, 30)
    assert agent.weights.num_downloads == 1 and len(agent.weights._index.entries()) == 1


def test_a_private_copy_stays_for_its_grace_from_its_last_release_even_across_an_agent_restart(
    s3, s3_endpoint, tmp_path,  # noqa: F811
):
    upload_model(s3, "org1-grace", "m", num_bytes=10_000, public=False)
    upload_model(s3, "catalogue-grace", "m", num_bytes=10_000)
    access = SourceAccess(credentials=org_credentials(s3_endpoint), scope="org-1")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, private_grace_s=60.0)
    private = cache.fetch("s3://org1-grace/m", access=access, pin=True)
    shared = cache.fetch("s3://catalogue-grace/m")
    for path in (private, shared):  # fetched a day ago; its replica ran since
        os.utime(cache.root / f"{path.name}.json", (time.time() - 86400,) * 2)
    assert cache.release_unwanted(set()) == []  # in use
    cache.unpin(private)  # its last replica ends now
    assert cache.release_unwanted(set()) == []  # within its grace
    restarted = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, private_grace_s=60.0)
    later = time.time() + 61
    assert restarted.release_unwanted({("s3://org1-grace/m", "org-1")}, now=later) == []  # wanted again
    assert restarted.release_unwanted({("s3://org1-grace/m", "org-2")}, now=later) == [private.name]
    assert not private.exists() and shared.exists()  # the catalogue's copy is the budget's to evict


def test_a_copy_pinned_by_a_fetch_racing_its_release_is_never_removed_under_it(s3, s3_endpoint, tmp_path):  # noqa: F811
    upload_model(s3, "org1-race", "m", num_bytes=10_000, public=False)
    access = SourceAccess(credentials=org_credentials(s3_endpoint), scope="org-1")
    cache = WeightsCache(tmp_path / "weights", s3_endpoint_url=s3_endpoint, private_grace_s=0.0)
    for _ in range(15):
        fetched: list = []
        pull = threading.Thread(target=lambda into=fetched: into.append(
            cache.fetch("s3://org1-race/m", access=access, pin=True)))
        pull.start()
        while pull.is_alive():
            cache.release_unwanted(set())
        pull.join()
        [path] = fetched
        cache.release_unwanted(set())
        assert (path / "model.safetensors").exists() and cache._index.is_complete(path.name)
        cache.unpin(path)
    assert cache.release_unwanted(set()) == [path.name] and not path.exists()


def test_a_rotated_credentials_old_client_is_dropped_and_never_serves_the_new_secret(store):  # noqa: F811
    old = SourceCredentials(kind="s3", access_key_id="AKIAROTATED", secret_access_key="old", endpoint_url=store)
    new = SourceCredentials(kind="s3", access_key_id="AKIAROTATED", secret_access_key="new", endpoint_url=store)
    before = connections_to(store)
    with s3_client(SourceAccess(credentials=old), "s3://b/m", default_endpoint_url=store) as old_client:
        list_with(old_client)
    assert connections_to(store) == before + 1
    weights_access.drop_clients_except([new])  # the desired replicas now carry the new secret
    assert not cached_clients_of(old) and connections_to(store) == before
    with s3_client(SourceAccess(credentials=new), "s3://b/m", default_endpoint_url=store) as new_client:
        assert new_client is not old_client
    assert cached_clients_of(new) and not cached_clients_of(old)


def test_a_running_replicas_refreshed_engine_key_brings_no_source_credentials_into_the_supervisor(
    control_plane, running_agent, s3, s3_endpoint, tokenizer_not_described,  # noqa: F811
):
    """Before: a new engine key in the desired spec copied the spec's source credentials into the supervisor's record
    of the replica, kept in memory for the engine's life (after the credential's deletion or rotation)."""
    upload_model(s3, "org1-refresh", "m", num_bytes=10_000, public=False)
    spec = {"model_source": "s3://org1-refresh/m", "credentials": org_credentials(s3_endpoint),
            "weights_scope": "org-1"}
    control_plane.desired = [make_spec("r-a", **spec)]
    agent, _stop, _thread = running_agent()
    wait_until(lambda: control_plane.last_states().get("r-a") == ReplicaState.READY, 30)
    with control_plane.lock:
        control_plane.desired = [make_spec("r-a", **spec, engine_api_key="rotated-engine-key")]
    wait_until(lambda: agent.supervisor.get("r-a").spec.engine_api_key == "rotated-engine-key", 10)
    assert agent.supervisor.get("r-a").spec.credentials is None


def test_a_release_that_fails_on_the_disk_never_fails_the_heartbeat_that_asked_for_it(
    control_plane, s3, s3_endpoint, tmp_path, monkeypatch,  # noqa: F811
):
    """Before: an error of the disk while a released copy was removed (here EIO from its manifest's removal) left
    `heartbeat_once` as an error after the answer was taken; the loop then backed off as from a control plane that
    failed, up to `max_backoff_s` (60 s by default, past the control plane's 30 s grace for a silent node) at every
    heartbeat while the fault lasted: the node went OFFLINE and its replicas were moved away, for a cleanup."""
    upload_model(s3, "org1-eio", "m", num_bytes=10_000, public=False)
    agent = Agent(
        AgentConfig(control_plane_url=control_plane.url, join_token=control_plane.join_token,
                    data_dir=tmp_path / "agent", s3_endpoint_url=s3_endpoint, force_cpu=True,
                    private_weights_grace_s=0.0),
        command_factory=fake_engine_factory(), policy=SupervisorPolicy(restart_backoff_s=0.2, stop_timeout_s=2.0),
    )
    try:
        access = SourceAccess(credentials=org_credentials(s3_endpoint), scope="org-1")
        agent.weights.fetch("s3://org1-eio/m", access=access)

        def failing_remove(key: str) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(agent.weights._index, "remove", failing_remove)
        control_plane.desired = []
        answer = agent.heartbeat_once()  # raised OSError before
        assert answer.desired == [] and agent.num_heartbeats == 1
        monkeypatch.undo()
        agent.heartbeat_once()  # the disk is back: released at the next answer
        assert agent.weights._index.entries() == []
    finally:
        agent.shutdown()


def test_a_private_download_stopped_a_moment_ago_keeps_its_grace_however_long_ago_it_began(tmp_path):
    """A partial download's folder is written when its download begins (its files are created and sized then; parts
    written into them later change their own times, not the folder's), and a resume creates nothing in it. Before,
    its grace ran from the folder's time: a download of an hour stopped a moment ago (its replica drained, its
    endpoint scaled to zero) was removed at the next heartbeat whatever the grace, and the scale back up within the
    grace fetched it all again. Its journal is rewritten at each part written: the grace runs from the later."""
    cache = WeightsCache(tmp_path / "weights", private_grace_s=60.0)
    key = "0123456789abcdef0123456789abcdef"
    partial = cache.root / ".tmp" / f"{key}.partial"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 1000)
    journal = cache.root / ".parts" / f"{key}.json"
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text(json.dumps({"part_bytes": 1000, "sizes": {"model.safetensors": 2000},
                                   "done": {"model.safetensors": [0]}, "source": "s3://org1/m", "scope": "org-1"}))
    an_hour_ago = time.time() - 3600
    os.utime(partial, (an_hour_ago, an_hour_ago))  # begun an hour ago; its journal written just now
    assert cache.release_unwanted(set()) == [] and partial.exists() and journal.exists()
    assert cache.release_unwanted(set(), now=time.time() + 61) == [key]
    assert not partial.exists() and not journal.exists()
