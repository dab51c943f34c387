"""One Lua script made of several owners' parts, with every offset computed, never counted by hand.

An owner (rate limits, the spend quota, traffic) writes its Lua functions once, each reading its own
keys and arguments as `K[1..]` and `A[1..]`, and declares what they are: a `ScriptPart`. A
`ComposedScript` lists the parts it calls, in order, and its glue: Lua that calls the owners'
functions on `<part>_K` and `<part>_A`, the slices of KEYS and ARGV this module cuts for each part.
At call time each part's keys and arguments are passed by name, checked against what the part
declares, and laid out in the same order:

    ADMIT = ComposedScript([limits.CHECK, quota.RESERVE], glue='''
    if limits_check(limits_check_K, limits_check_A) ~= 0 then return 0 end
    return quota_reserve(quota_reserve_K, quota_reserve_A)''')
    await ADMIT(limits_check=(keys, args), quota_reserve=(keys, args))

Only the last part may take a variable number of keys (`variadic_keys`: at least those it declares).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.redis_scripts import Script

_LUA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Copies t[from..to] into a new table: each part reads its own K and A from 1. (`unpack` into a table
# constructor: one C call, where a Lua loop appending one by one cost a script ~1 µs a slice in Redis.)
_SLICE = """
local function slice(t, from, to)
  return {unpack(t, from, to)}
end
"""


@dataclass(frozen=True, slots=True)
class ScriptPart:
    """An owner's Lua function(s) and the keys and arguments they read, in order (K[1] is `keys[0]`)."""

    name: str  # the glue reads its keys and arguments as `<name>_K` and `<name>_A`
    keys: tuple[str, ...]  # what each key is, for readers and error messages
    args: tuple[str, ...]
    lua: str  # the owner's source defining the functions the glue calls
    variadic_keys: bool = False  # any number of further keys (as many as the caller has) after `keys`

    def __post_init__(self) -> None:
        if not _LUA_NAME.match(self.name):
            raise ValueError(f"a part's name is a Lua name, not {self.name!r}")

    def check(self, keys: Sequence, args: Sequence) -> None:
        """Refuse keys or arguments that are not what this part declares."""
        if len(keys) != len(self.keys) and not (self.variadic_keys and len(keys) >= len(self.keys)):
            raise ValueError(f"{self.name} takes {len(self.keys)}{' or more' if self.variadic_keys else ''} keys "
                             f"({', '.join(self.keys)}), not {len(keys)}")
        if len(args) != len(self.args):
            raise ValueError(f"{self.name} takes {len(self.args)} arguments ({', '.join(self.args)}), not {len(args)}")


class ComposedScript:
    """`parts` in order, and the Lua `glue` that calls them; run with each part's (keys, args) by name."""

    def __init__(self, parts: Sequence[ScriptPart], glue: str):
        names = [part.name for part in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"two parts share a name: {names}")
        if any(part.variadic_keys for part in parts[:-1]):
            raise ValueError("only the last part may take a variable number of keys")
        self.parts = tuple(parts)
        self.offsets: dict[str, tuple[int, int]] = {}  # part -> (its first key, its first argument), 1-based
        libraries: list[str] = []
        slices: list[str] = []
        key_at, arg_at = 1, 1
        for part in self.parts:
            if part.lua not in libraries:
                libraries.append(part.lua)
            self.offsets[part.name] = (key_at, arg_at)
            last_key = "#KEYS" if part.variadic_keys else str(key_at + len(part.keys) - 1)
            slices.append(f"local {part.name}_K = slice(KEYS, {key_at}, {last_key})")
            slices.append(f"local {part.name}_A = slice(ARGV, {arg_at}, {arg_at + len(part.args) - 1})")
            key_at += len(part.keys)
            arg_at += len(part.args)
        self.source = "".join(libraries) + _SLICE + "\n".join(slices) + "\n" + glue
        # NOTE: a part's arguments are a call's fields (ids, counts, limits, flags), never rows: small, most recurring
        self._script = Script(self.source, small_args=True)
        self._names = frozenset(self.offsets)  # NOTE: compared with each call's names as they are: no set built
        # NOTE: each part's declared counts, read once here: a call compares its lengths with them inline, and asks
        # the part (`ScriptPart.check`, its message) only when they differ. Two scripts a request, nine parts: a call of
        # `check` and four `len`s a part were ~45 of a request's calls.
        self._layout = tuple((part, part.name, len(part.keys), len(part.args), part.variadic_keys) for part in self.parts)

    def keys_and_args(self, **values: tuple[Sequence, Sequence]) -> tuple[list, list]:
        """KEYS and ARGV for the parts' (keys, args), laid out at the computed offsets."""
        if values.keys() != self._names:
            raise ValueError(f"expected keys and arguments for {sorted(self.offsets)}, got {sorted(values)}")
        keys: list = []
        args: list = []
        for part, name, num_keys, num_args, variadic in self._layout:
            part_keys, part_args = values[name]
            keys += part_keys
            args += part_args
            if len(part_args) != num_args or (len(part_keys) != num_keys
                                              and not (variadic and len(part_keys) > num_keys)):
                part.check(part_keys, part_args)  # raises, naming what the part takes
        return keys, args

    async def __call__(self, **values: tuple[Sequence, Sequence]):
        keys, args = self.keys_and_args(**values)
        return await self._script(keys=keys, args=args)

    def run_sync(self, **values: tuple[Sequence, Sequence]):
        """The same from synchronous code (tasks), on the process's shared client."""
        keys, args = self.keys_and_args(**values)
        return self._script.run_sync(keys=keys, args=args)
