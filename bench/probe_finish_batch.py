"""What settling a loop turn's finishes in one Redis script would save the gateway's CPU (issue #20).

Today each finished request runs its own EVALSHA on `controlplane.redis_scripts`' one connection,
whose calls of one loop turn already go out in one write and whose replies one read can answer. This
probe measures the client CPU (`time.process_time`) per finish of `n` finishes in one turn, each with
the finish script's ~12 keys and ~14 arguments: `n` EVALSHA as today, against one script over the
list of all `n` (a call_soon batcher, each caller awaiting its own result), alternating, on uvloop,
against the embedded Redis of this worktree's `.data`. The scripts are stand-ins (one HINCRBY each):
Redis's own time is not the gateway's CPU.

    .venv/bin/python bench/probe_finish_batch.py

The record of what it showed: `bench/results/gateway_profile.md`, round 3.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ["INFERPLANE_DATA_DIR"] = str(REPO / ".data")
os.environ["DJANGO_DEBUG"] = "1"
os.environ.setdefault("DATABASE_URL", "postgresql://unused@127.0.0.1:1/unused")  # never opened

from controlplane import embedded  # noqa: E402 - after the environment is set

os.environ["REDIS_URL"] = embedded.ensure_redis()

import django  # noqa: E402

django.setup()

import uvloop  # noqa: E402

from controlplane.redis_scripts import Script  # noqa: E402

NUM_KEYS, NUM_ARGS = 12, 14  # about the finish script's
ONE = Script("redis.call('HINCRBY', KEYS[1], 'n', 1) return {'ok', ARGV[1]}")
MANY = Script("""local out, n, k, a = {}, tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 0, n - 1 do redis.call('HINCRBY', KEYS[i * k + 1], 'n', 1) out[i + 1] = {'ok', ARGV[4 + i * a]} end
return out""")


def keys_and_args(i: int) -> tuple[list[str], list[str]]:
    return [f"{{org:7}}:probe:{j}:{i % 50}" for j in range(NUM_KEYS)], [str(i * 1000 + j) for j in range(NUM_ARGS)]


async def single(i: int):
    keys, args = keys_and_args(i)
    return await ONE(keys=keys, args=args)


class Batcher:
    """The finishes submitted in one loop turn, sent as one script over the list."""

    def __init__(self):
        self.pending: list[tuple[list, list, asyncio.Future]] = []

    def submit(self, keys: list, args: list) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.pending:
            loop.call_soon(self.flush)
        self.pending.append((keys, args, future))
        return future

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        keys, args = [], [len(pending), NUM_KEYS, NUM_ARGS]
        for part_keys, part_args, _ in pending:
            keys += part_keys
            args += part_args

        def answer(task: asyncio.Task) -> None:
            if task.exception() is not None:
                for *_, future in pending:
                    future.set_exception(task.exception())
                return
            for (_, _, future), result in zip(pending, task.result(), strict=True):
                future.set_result(result)

        asyncio.ensure_future(MANY(keys=keys, args=args)).add_done_callback(answer)


BATCHER = Batcher()


async def batched(i: int):
    keys, args = keys_and_args(i)
    return await BATCHER.submit(keys, args)


async def cpu_us_per_finish(finish, turns: int, n: int) -> float:
    started = time.process_time()
    for turn in range(turns):
        results = await asyncio.gather(*[finish(turn * n + i) for i in range(n)])
        assert results[0][0] == "ok"
    return (time.process_time() - started) / (turns * n) * 1e6


async def main() -> None:
    for n in (1, 4, 16):
        await cpu_us_per_finish(single, 50, n)
        await cpu_us_per_finish(batched, 50, n)
        today, one_script = [], []
        for _ in range(6):
            today.append(await cpu_us_per_finish(single, 400 // n + 50, n))
            one_script.append(await cpu_us_per_finish(batched, 400 // n + 50, n))
        today.sort()
        one_script.sort()
        print(f"{n:>2} finishes a turn: client CPU µs per finish, EVALSHA each (today) median {today[3]:.1f} "
              f"{[round(x) for x in today]}, one script over the list median {one_script[3]:.1f} "
              f"{[round(x) for x in one_script]}")


if __name__ == "__main__":
    uvloop.run(main())
