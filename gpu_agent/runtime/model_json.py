"""A JSON file from a tenant's model folder (config.json, adapter_config.json), read only up to a size.

NOTE: the tenant writes these files, and the agent reads them on its heartbeat thread (every cached model's
config.json) and before each launch. `json.loads` of a whole file took memory and time in proportion to it,
tens of times its size for a config of empty objects: 30 MB took ~760 MB, a GB stalled the heartbeat for
minutes (the node went offline with every tenant's replicas), ten GB got the agent killed. A file past
`MAX_MODEL_JSON_BYTES` is refused before it is read, and no more than that is ever read, as the safetensors
headers are capped (`safetensors_headers.MAX_HEADER_BYTES`).

NOTE: imports nothing but the standard library (the agent ships without Django).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# Real configs are a few KB (the largest, per-layer quantization settings of big MoE models, some hundred KB);
# parsing this much takes ~100 MB and under a second at worst (a file of nothing but `{},`).
MAX_MODEL_JSON_BYTES = 4 * 1024 * 1024
# Past this, a file too large to parse is not even scanned (`file_holds`): judged to hold any key, unread.
MAX_SCANNED_BYTES = 256 * 1024**2
# A `\uXXXX` escape of a printable ASCII character, of which every key is spelled: JSON may spell any character of a
# key so (`"fast\u005ftokenizer_files"`), and the loader's `json.load` decodes it to the same field; `json.dumps` never
# writes one for printable ASCII.
_ESCAPED_ASCII = re.compile(rb"\\u00[2-7][0-9a-fA-F]")


class ModelJsonTooLarge(Exception):
    """A model's JSON file is past `MAX_MODEL_JSON_BYTES`; the message says which, for the replica's reason.

    NOTE: not a ValueError, so a caller that treats unreadable JSON as absent cannot swallow it by accident.
    """


def read_model_json(path: str | Path) -> object:
    """The parsed JSON of a file in a tenant's model folder.

    Raises `ModelJsonTooLarge` past `MAX_MODEL_JSON_BYTES`, `OSError` when it cannot be read, `ValueError` or
    `RecursionError` when it is not UTF-8 JSON.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size > MAX_MODEL_JSON_BYTES:
            raise _too_large(path)
        # One byte more than the cap: a file that grew since the stat (or a device) is refused, not read whole.
        data = handle.read(MAX_MODEL_JSON_BYTES + 1)
    if len(data) > MAX_MODEL_JSON_BYTES:
        raise _too_large(path)
    return json.loads(data.decode("utf-8"))


def file_holds(path: str | Path, key: bytes) -> bool:
    """Whether the file's bytes may hold `key` (read a MiB at a time, never whole): True when they hold it or any JSON
    escape of a printable ASCII character (which may spell it), when the file is past `MAX_SCANNED_BYTES`, or when it
    cannot be read.

    NOTE: how a file past `MAX_MODEL_JSON_BYTES` is judged without being parsed: one that does not even hold a field's
    name, spelled out or escaped, cannot set that field. One past `MAX_SCANNED_BYTES` is judged unread: a 4 GiB
    (sparse) file took 58 s to scan."""
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size > MAX_SCANNED_BYTES:
                return True
            tail, num_read = b"", 0
            while chunk := handle.read(1024 * 1024):
                num_read += len(chunk)
                window = tail + chunk
                if num_read > MAX_SCANNED_BYTES or key in window or _ESCAPED_ASCII.search(window):
                    return True  # NOTE: past the bound: a file that grew since the stat is judged unread too
                tail = window[-max(len(key), 6) :]
    except OSError:
        return True
    return False


def _too_large(path: Path) -> ModelJsonTooLarge:
    return ModelJsonTooLarge(f"its {path.name} is larger than {MAX_MODEL_JSON_BYTES // (1024 * 1024)} MiB")
