"""`<data-dir>/replicas.json`: the engines this agent runs, so the next agent on the data dir can adopt them, and what
it read of its node that a restart must not forget.

Written atomically (a temporary file, then a rename) with mode 0600 after every launch, exit and
failure, and when a reading kept here changes; read once (`StateFile.records`, by `Supervisor.recover`;
`StateFile.readings`, by `Agent`). Only replicas with a live engine are recorded, each with its scratch folder
(`SCRATCH_KEY`: what the next agent measures or removes, never what the engine says; an older agent ignores the key).
A scratch folder made for a launch is recorded before its engine starts (`MADE_SCRATCH_KEY`, until its engine is
recorded): an agent killed in between leaves none that only the engine's owner file names.

The readings (`StateFile.save_reading`: a confirmed refusal of namespaces, the safetensors readers' back-offs) are
stamped with the node's boot, their times on its monotonic clock: those of another boot are ignored. NOTE: a file
this agent did not write is trusted for nothing (not adopted from, no reading taken): not a regular file of the
agent's own user, writable by another (group or others), or not what it writes; each is ignored with a log line. An
engine confined with Landlock cannot write it (`tests/agent/test_engine_sandbox.py`). NOTE: an engine runs as the
agent's own user: under `best-effort` on a kernel without Landlock it runs unconfined and can write this file (plant
records and readings: a refusal of namespaces, which then start its next engines without them), which no check of the
file's owner or mode can tell from the agent's; only `required` (no engine unconfined) rules that out.

NOTE: one-way: an agent from before the readings takes the key `""` for a replica's record it cannot read: it logs
a traceback and "killed replicas left by a previous agent: ['']" (no process carries an empty replica id: none is
killed for it), then rewrites the file without it at the end of its recovery, the readings forgotten.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from gpu_agent.protocol import ReplicaSpec, ReplicaState
from gpu_agent.runtime import durable
from gpu_agent.runtime.engine import EngineCommand
from gpu_agent.runtime.replica_state import ManagedReplica

logger = logging.getLogger(__name__)

# NOTE: the readings' key beside the replicas' records: no replica has an empty id (`ReplicaSpec`), and an older
# agent skips a record it cannot read (with a traceback) and adopts the others (the module's docstring).
READINGS_KEY = ""
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_STATE_BYTES = 64 * 1024 * 1024  # past this the file is no state this agent wrote


def boot_id() -> str:
    """This boot of the node ("" where unknown): monotonic times of another boot mean nothing here."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return ""


# A record's key for its engine's scratch folder (`sandbox.make_scratch_folder`): null when it has none (the sandbox off);
# missing from an older agent's records.
SCRATCH_KEY = "scratch_dir"
NOT_RECORDED = object()  # `recorded_scratch` of an older agent's record
# A record's key for the context its engine was launched with (`EngineCommand.max_model_len`): null for a stand-in
# engine's command (a test's); missing from an older agent's records, whose engines may have been launched with none.
LAUNCHED_CONTEXT_KEY = "max_model_len"


# NOTE: the scratch folders made for launches whose engines are not recorded yet (`StateFile.made_scratch`), as a list
# of [replica id, path]: the key is longer than any replica id (`protocol.MAX_REPLICA_ID_CHARS`), and a list is no
# record (an agent from before it skips it).
MADE_SCRATCH_KEY = "scratch folders made for engines not yet recorded"


def _made_scratch(records: Mapping[str, dict], scratch_dirs: Mapping[str, Path]) -> list[list[str]]:
    return [[replica_id, str(path)] for replica_id, path in scratch_dirs.items() if replica_id not in records]


def _records(replicas: Iterable[ManagedReplica], scratch_dirs: Mapping[str, Path]) -> dict[str, dict]:
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
            # NOTE: None for a stand-in engine's command (a test's), which is not checked (`Supervisor.recover`).
            LAUNCHED_CONTEXT_KEY: replica.command.max_model_len,
            "model_path": str(replica.model_path),
            # NOTE: source credentials never go to disk. The engine key does (this file is 0600,
            # like node.json): the next agent must reach an engine it adopts to drain it.
            "spec": replica.spec.without_secrets().to_dict(),
            "engine_api_key": replica.spec.engine_api_key,
            "num_restarts": replica.num_restarts,
            "sleeping": replica.state == ReplicaState.SLEEPING,
            # NOTE: where the next agent finds its scratch folder, to measure it (adopted) or remove it (killed): the
            # engine may rewrite its owner file and its environment, never this file (`sandbox.recorded_scratch_folder`)
            SCRATCH_KEY: str(scratch_dirs[replica.spec.replica_id]) if replica.spec.replica_id in scratch_dirs else None,
        }
    return records


def _read_own(path: Path) -> dict | None:
    """The file's JSON object, if this agent's user wrote it and no one else can (None, logged, otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("the agent's state file %s cannot be opened (%s): ignored", path, exc.strerror)
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            logger.warning("the agent's state file %s is not this agent's own (uid %d, mode %o): ignored", path,
                           info.st_uid, stat.S_IMODE(info.st_mode))  # fmt: skip
            return None
        try:
            data = json.loads(handle.read(MAX_STATE_BYTES + 1))
        except (OSError, ValueError) as exc:
            logger.warning("the agent's state file %s cannot be read (%s): ignored", path, exc)
            return None
    if not isinstance(data, dict):
        logger.warning("the agent's state file %s holds no records: ignored", path)
        return None
    return data


class StateFile:
    """The agent's state file: its engines' records and its readings of the node, read once, written whole."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # a leaf: nothing is called under it
        self._records: dict[str, dict] | None = None  # None: not read yet
        self._readings: dict[str, object] = {}
        self._made_scratch: list[list[str]] = []

    def records(self) -> dict[str, dict]:
        """The records by replica id, as read from the file; none when it is missing, unreadable or not the agent's
        own."""
        with self._lock:
            self._read_once()
            return dict(self._records)

    def readings(self) -> dict[str, object]:
        """The readings kept on this boot, by name; those of another boot (or none known) are ignored."""
        with self._lock:
            self._read_once()
            return dict(self._readings)

    def made_scratch(self) -> list[tuple[str, object]]:
        """The scratch folders made for launches whose engines the file does not record, as (replica id, path as
        written): what an agent killed between making one and starting its engine left."""
        with self._lock:
            self._read_once()
            return [(pair[0], pair[1]) for pair in self._made_scratch]

    def save(self, replicas: Iterable[ManagedReplica], scratch_dirs: Mapping[str, Path] | None = None) -> bool:
        """Record the replicas with a live engine and their scratch folders (by replica id), and the scratch folders of
        the others (made for a launch, its engine not started yet); the readings kept as they are. False when the file
        could not be written (the disk full: logged; the next save writes all of it), never raises.

        NOTE: before, the OSError went up: on a full disk a launch's save raised, the poll failed the replica, whose own
        save raised again, and the rest of the poll (the other replicas' steps, the standby) was skipped. A caller that
        must not go on unrecorded looks at the answer (`Supervisor._confined`)."""
        records = _records(replicas, scratch_dirs or {})
        made = _made_scratch(records, scratch_dirs or {})
        with self._lock:
            self._read_once()
            self._records = records
            self._made_scratch = made
            try:
                self._write()
            except OSError as exc:
                logger.warning("the agent's state file %s could not be written (%s)", self.path, exc.strerror)
                return False
        return True

    def save_reading(self, name: str, value) -> None:
        """Keep a reading (JSON) across restarts, or forget it (None). Never raises: a reading not written (the disk
        full) is logged, and its owner goes on as it would have."""
        with self._lock:
            self._read_once()
            if value is None:
                self._readings.pop(name, None)
            else:
                self._readings[name] = value
            try:
                self._write()
            except OSError as exc:
                logger.warning("the agent's state file %s could not be written (%s)", self.path, exc.strerror)

    def _read_once(self) -> None:
        if self._records is not None:
            return
        durable.remove_leftovers(self.path)  # a write killed before its rename (`durable.write_atomic`)
        data = _read_own(self.path) or {}
        readings = data.pop(READINGS_KEY, None)
        made = data.pop(MADE_SCRATCH_KEY, None)
        if isinstance(made, list):
            self._made_scratch = [pair for pair in made
                                  if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)]
        self._records = {key: record for key, record in data.items() if isinstance(record, dict)}
        if readings is None:
            return
        this_boot = boot_id()
        if not isinstance(readings, dict) or not this_boot or readings.get("boot_id") != this_boot:
            logger.info("the agent's state file %s holds readings of another boot: ignored", self.path)
            return
        self._readings = {name: value for name, value in readings.items() if name != "boot_id"}

    def _write(self) -> None:
        data = dict(self._records)
        if self._made_scratch:
            data[MADE_SCRATCH_KEY] = self._made_scratch
        if self._readings:
            data[READINGS_KEY] = {"boot_id": boot_id(), **self._readings}
        # NOTE: a file of its own each time (0600, O_EXCL): never written through one someone else made there; and
        # durably (`durable`): a power loss leaves the old records or the new ones, never an empty file.
        durable.write_atomic(self.path, json.dumps(data, indent=2), mode=0o600)


def recorded_scratch(record: dict) -> object:
    """What a record says of its engine's scratch folder, as written (a path, or None for none); `NOT_RECORDED` when
    an older agent wrote it, which recorded none."""
    return record.get(SCRATCH_KEY, NOT_RECORDED) if isinstance(record, dict) else NOT_RECORDED


def replica_from_record(replica_id: str, record: dict, logs_dir: Path, desired: dict[str, ReplicaSpec] | None) -> ManagedReplica:
    """The replica a record describes, with its desired spec when there is one (for adoption)."""
    spec = dataclasses.replace(ReplicaSpec.from_dict(record["spec"]), engine_api_key=record.get("engine_api_key", ""))
    command = EngineCommand(argv=record.get("argv", []), host=record["host"], port=record["port"],
                            advertise_host=record.get("advertise_host", ""),
                            max_model_len=record.get(LAUNCHED_CONTEXT_KEY))
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
