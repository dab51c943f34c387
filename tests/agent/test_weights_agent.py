"""What a real agent loop reports when weights cannot be fetched, and where a replica's credentials end up (nowhere)."""

from __future__ import annotations

import logging
import os

from gpu_agent.protocol import ReplicaState, SourceCredentials

from .conftest import make_spec, wait_until
from .test_agent_loop import control_plane, running_agent  # noqa: F401  (fixtures)
from .test_weights_cache import s3, s3_endpoint, upload_model  # noqa: F401  (fixtures)

SECRET = "wJalrXUtnFEMI-do-not-leak-7MDENG"
SESSION_TOKEN = "FwoGZXIvYXdzE-do-not-leak-session"


def reported(control_plane, replica_id: str, state: ReplicaState):  # noqa: F811
    def find():
        with control_plane.lock:
            beats = list(control_plane.heartbeats)
        for beat in reversed(beats):
            for status in beat.replicas:
                if status.replica_id == replica_id and status.state == state:
                    return status
        return None

    # NOTE: a first reading of a model starts the tokenizer's describing child (transformers' import, ~4.5 s of CPU):
    # a loaded machine's run took past 30 s.
    return wait_until(find, 90)


def test_a_replica_whose_object_keys_escape_the_cache_is_failed_with_the_reason(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    s3,  # noqa: F811
    tmp_path,
):
    target = tmp_path / "outside" / "planted"
    s3.create_bucket(Bucket="agent-escape")
    for key in ("p/config.json", f"p/{target}"):  # the second key is p//tmp/.../planted
        s3.put_object(Bucket="agent-escape", Key=key, Body=b"owned", ACL="public-read")
    control_plane.desired = [make_spec("r-escape", model_source="s3://agent-escape/p")]
    running_agent()
    status = reported(control_plane, "r-escape", ReplicaState.FAILED)
    assert status.failure_reason == (
        f"fetching weights from s3://agent-escape/p failed: refusing the model file name {str(target)!r}: "
        "it is an absolute path"
    )
    assert not os.path.lexists(target) and not os.path.lexists(target.parent)


def test_a_model_over_the_nodes_budget_is_failed_with_its_size(control_plane, running_agent, s3):  # noqa: F811
    upload_model(s3, "agent-huge", "m", num_bytes=3_000_000)
    control_plane.desired = [make_spec("r-huge", model_source="s3://agent-huge/m")]
    agent, _stop, _thread = running_agent(weights_budget_bytes=2_000_000)
    status = reported(control_plane, "r-huge", ReplicaState.FAILED)
    assert status.failure_reason == (
        "fetching weights from s3://agent-huge/m failed: model is 3 MB; this node's weights budget is 2 MB"
    )
    assert agent.weights.num_downloads == 0


def test_a_replicas_credentials_reach_neither_disk_nor_logs_nor_failure_reasons(
    control_plane,  # noqa: F811
    running_agent,  # noqa: F811
    s3,  # noqa: F811
    s3_endpoint,  # noqa: F811
    tmp_path,
    caplog,
):
    caplog.set_level(logging.DEBUG, logger="gpu_agent")
    upload_model(s3, "agent-private", "m", num_bytes=1000, public=False)
    credentials = SourceCredentials(
        kind="s3",
        access_key_id="AKIAORGANISATION0001",
        secret_access_key=SECRET,
        session_token=SESSION_TOKEN,
        region="us-east-1",
        endpoint_url=s3_endpoint,
    )
    control_plane.desired = [
        make_spec(
            "r-own", model_source="s3://agent-private/m", credentials=credentials, weights_scope="org-1"
        ),
        make_spec(
            "r-gone", model_source="s3://agent-missing/m", credentials=credentials, weights_scope="org-1"
        ),
    ]
    agent, _stop, _thread = running_agent()
    reported(control_plane, "r-own", ReplicaState.READY)
    failed = reported(control_plane, "r-gone", ReplicaState.FAILED)
    assert failed.failure_reason == (
        "fetching weights from s3://agent-missing/m failed: cannot read s3://agent-missing/m: "
        "it does not exist or the endpoint's credentials cannot read it"
    )
    assert agent.weights.num_downloads == 1
    for directory, _folders, files in os.walk(agent.config.data_dir):
        for name in files:
            content = open(os.path.join(directory, name), "rb").read()
            for secret in (SECRET, SESSION_TOKEN):
                assert secret.encode() not in content, f"a secret was written to {directory}/{name}"
    for secret in (SECRET, SESSION_TOKEN):
        assert secret not in caplog.text
