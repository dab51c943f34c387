"""`<data-dir>/replicas.json`: the engines this agent runs, so the next agent on the data dir can adopt them.

Written atomically (a temporary file, then a rename) with mode 0600 after every launch, exit and
failure; read once, by `Supervisor.recover`. Only replicas with a live engine are recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path

from gpu_agent.protocol import ReplicaSpec, ReplicaState
from gpu_agent.runtime.engine import EngineCommand
from gpu_agent.runtime.replica_state import ManagedReplica


def save(path: Path, replicas: Iterable[ManagedReplica]) -> None:
    records = {}
    for replica in replicas:
        if replica.pid is None or replica.command is None:
            continue
        records[replica.spec.replica_id] = {
            "pid": replica.pid,
            "host": replica.command.host,
            "advertise_host": replica.command.advertise_host,
            "port": replica.command.port,
            "argv": replica.command.argv,
            "model_path": str(replica.model_path),
            # NOTE: source credentials never go to disk. The engine key does (this file is 0600,
            # like node.json): the next agent must reach an engine it adopts to drain it.
            "spec": replica.spec.without_secrets().to_dict(),
            "engine_api_key": replica.spec.engine_api_key,
            "num_restarts": replica.num_restarts,
            "sleeping": replica.state == ReplicaState.SLEEPING,
        }
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(records, indent=2))
    os.replace(tmp, path)


def load(path: Path) -> dict[str, dict]:
    """The records by replica id; none when the file is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def replica_from_record(replica_id: str, record: dict, logs_dir: Path, desired: dict[str, ReplicaSpec] | None) -> ManagedReplica:
    """The replica a record describes, with its desired spec when there is one (for adoption)."""
    spec = dataclasses.replace(ReplicaSpec.from_dict(record["spec"]), engine_api_key=record.get("engine_api_key", ""))
    command = EngineCommand(argv=record.get("argv", []), host=record["host"], port=record["port"],
                            advertise_host=record.get("advertise_host", ""))
    wanted_spec = desired.get(replica_id, spec) if desired else spec
    if not wanted_spec.engine_api_key:  # the running engine holds the key it was started with
        wanted_spec = dataclasses.replace(wanted_spec, engine_api_key=spec.engine_api_key)
    return ManagedReplica(
        spec=wanted_spec,
        model_path=Path(record["model_path"]),
        log_path=logs_dir / f"{replica_id}.log",
        command=command,
        pid=record.get("pid"),
        num_restarts=record.get("num_restarts", 0),
    )
