"""`make run`'s restarts of a Celery worker or beat that exited (`manage.py run_local`), as Kubernetes restarts a
Deployment's container: at once after a run that stayed up, then after a delay that doubles with each exit that
follows a short run (`RESTART_FIRST_DELAY_S`, 2, 4, … up to `RESTART_MAX_DELAY_S`), back to at once after a run of
`RESTART_STABLE_AFTER_S` (its CrashLoopBackOff).

NOTE: a process that died every 10 s or more (a broker its library does not survive, a task that kills its worker)
was started again at once, for ever: each start's imports and connections, and its log filled with its tracebacks.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

# NOTE: a Celery process that dies (a broker fault its library does not survive) is started again, as in a pod;
# the web server is what a user watches, and its exit stops `make run`.
RESTARTED_ON_EXIT = ("worker", "beat")
# One that exits sooner after its start cannot start (its log says why): `make run` stops.
RESTART_MIN_UPTIME_S = 10.0
RESTART_FIRST_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 60.0
# A run this long resets the delay: the next exit restarts at once.
RESTART_STABLE_AFTER_S = 120.0
# NOTE: the doublings that reach `RESTART_MAX_DELAY_S`; more are not computed: `2 ** 1024` is past a float (an
# OverflowError, after ~20 h of short runs, stopped `make run`).
_MAX_DOUBLINGS = math.ceil(math.log2(RESTART_MAX_DELAY_S / RESTART_FIRST_DELAY_S))


def restart_delay_s(num_short_runs: int) -> float:
    """The wait before the next start after `num_short_runs` runs in a row shorter than `RESTART_STABLE_AFTER_S`."""
    if num_short_runs <= 0:
        return 0.0
    return min(RESTART_MAX_DELAY_S, RESTART_FIRST_DELAY_S * 2 ** min(num_short_runs - 1, _MAX_DOUBLINGS))


@dataclass(slots=True)
class Supervised:
    """One process `make run` watches: its child, when it started and how many short runs in a row it had."""

    name: str
    child: subprocess.Popen
    started_at: float
    num_short_runs: int = 0
    restart_at: float | None = None  # set while it waits for its next start


@dataclass(slots=True)
class Supervisor:
    """`start(name)` starts a process; `write` says what happens (`make run`'s stderr). `now`: a monotonic clock."""

    start: Callable[[str], subprocess.Popen]
    write: Callable[[str], None]
    processes: dict[str, Supervised] = field(default_factory=dict)

    def launch(self, name: str, now: float) -> subprocess.Popen:
        child = self.start(name)
        supervised = self.processes.get(name)
        if supervised is None:
            self.processes[name] = Supervised(name, child, now)
        else:
            supervised.child, supervised.started_at, supervised.restart_at = child, now, None
        return child

    def children(self) -> list[subprocess.Popen]:
        return [supervised.child for supervised in self.processes.values()]

    def check(self, now: float, log_of: Callable[[str], object]) -> bool:
        """Start again each worker or beat whose exit was seen and whose delay is over, and note new exits; True,
        to stop everything, when the web server exited or one exited within `RESTART_MIN_UPTIME_S` of its start.
        `log_of(name)`: where its log is, named in the exit's line."""
        for supervised in self.processes.values():
            name = supervised.name
            if supervised.restart_at is not None:
                if now >= supervised.restart_at:
                    self.launch(name, now)
                    self.write(f"{name} started again")
                continue
            if supervised.child.poll() is None:
                continue
            self.write(f"{name} exited with {supervised.child.returncode}; see {log_of(name)}")
            uptime_s = now - supervised.started_at
            if name not in RESTARTED_ON_EXIT or uptime_s < RESTART_MIN_UPTIME_S:
                return True
            supervised.num_short_runs = (
                0 if uptime_s >= RESTART_STABLE_AFTER_S else supervised.num_short_runs + 1
            )
            delay_s = restart_delay_s(supervised.num_short_runs)
            if delay_s:
                self.write(
                    f"{name} starts again in {delay_s:.0f} s: its run {supervised.num_short_runs} in a row "
                    f"shorter than {RESTART_STABLE_AFTER_S:.0f} s (the wait doubles up to "
                    f"{RESTART_MAX_DELAY_S:.0f} s)"
                )
            supervised.restart_at = now + delay_s
            if not delay_s:
                self.launch(name, now)
                self.write(f"{name} started again")
        return False
