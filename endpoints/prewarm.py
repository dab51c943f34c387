"""An endpoint's scheduled floor: pre-warm windows and the keep-warm hint after a cold start.

A pre-warm window raises the endpoint's floor of replicas while it is open:

    {"schedule": "0 9 * * 1-5", "timezone": "Europe/Paris", "duration_minutes": 600, "min_replicas": 2}

opens at 09:00 Paris time on weekdays and stays open ten hours. `schedule` is a five-field cron
expression (minute hour day-of-month month day-of-week, as croniter reads it), evaluated in
`timezone` (an IANA name), so a window follows its users' clock across daylight-saving changes.

`keep_warm_after_cold_start_s` is a hint for spiky endpoints: after a cold start, keep at least
one replica for that long even when idle, so the next burst does not pay for another.

The autoscaler (`endpoints.autoscaler.decide`) takes the largest of `min_replicas`, the open
windows' floors and the keep-warm floor; this module only says what those are at a given time,
and validates what users send (`validate_windows`, used by the API and the console form).
"""

from __future__ import annotations

import functools
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from croniter import CroniterBadCronError, CroniterBadDateError, croniter

MAX_WINDOWS = 10
MAX_DURATION_MINUTES = 7 * 24 * 60
# A schedule's length: every minute of an hour listed is 170 characters. NOTE: croniter's time grows with a field's
# entries, and the autoscaler's one tick reads every stored schedule several times: ten windows of 90,000 listed
# minutes took ~6 s a read, a tick ~30 s, scale-ups and scale-to-zero stalled for every tenant.
MAX_SCHEDULE_CHARS = 200
WINDOW_FIELDS = {"schedule", "timezone", "duration_minutes", "min_replicas"}
# Schedules are tried from here when validated: one that occurs at all occurs within croniter's search of it.
PROBE_AT = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(slots=True, frozen=True)
class Floor:
    replicas: int
    reason: str  # what sets it, for the decision's reason and the event log


def validate_windows(value, *, max_replicas: int | None = None) -> list[str]:
    """Problems with a list of windows, each naming the window and field (empty when it is fine)."""
    if not isinstance(value, list):
        return ["Must be a list of windows."]
    if len(value) > MAX_WINDOWS:
        return [f"At most {MAX_WINDOWS} windows."]
    problems = []
    for number, window in enumerate(value, start=1):
        where = f"Window {number}"
        if not isinstance(window, dict):
            problems.append(f"{where}: must be an object with {', '.join(sorted(WINDOW_FIELDS))}.")
            continue
        unknown = set(window) - WINDOW_FIELDS
        if unknown:
            problems.append(f"{where}: unknown field(s) {', '.join(sorted(unknown))}.")
        missing = WINDOW_FIELDS - set(window)
        if missing:
            problems.append(f"{where}: missing {', '.join(sorted(missing))}.")
            continue
        schedule = window["schedule"]
        if isinstance(schedule, str) and len(schedule) > MAX_SCHEDULE_CHARS:
            problems.append(f"{where}: schedule may be at most {MAX_SCHEDULE_CHARS} characters long.")
        elif not isinstance(schedule, str) or len(schedule.split()) != 5 or not _valid_cron(schedule):
            problems.append(f"{where}: schedule must be a five-field cron expression, e.g. \"0 9 * * 1-5\".")
        elif not _occurs(schedule):
            problems.append(f"{where}: schedule names a date that never comes (such as 30 February or 31 April).")
        if not isinstance(window["timezone"], str) or window["timezone"] not in _timezones():
            problems.append(f"{where}: timezone must be an IANA time zone name, e.g. \"Europe/Paris\".")
        duration = window["duration_minutes"]
        if isinstance(duration, bool) or not isinstance(duration, int) or not 1 <= duration <= MAX_DURATION_MINUTES:
            problems.append(f"{where}: duration_minutes must be a whole number from 1 to {MAX_DURATION_MINUTES}.")
        replicas = window["min_replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            problems.append(f"{where}: min_replicas must be a whole number of at least 1.")
        elif max_replicas is not None and replicas > max_replicas:
            problems.append(f"{where}: min_replicas ({replicas}) is above the endpoint's max_replicas ({max_replicas}).")
    return problems


def window_floor(windows: list[dict], now: datetime) -> Floor:
    """The highest floor among the windows open at `now` (an aware datetime)."""
    best = Floor(0, "")
    for window in windows or []:
        opened = _opened_at(window, now)
        if opened is not None and window["min_replicas"] > best.replicas:
            closes = (opened + timedelta(minutes=window["duration_minutes"])).strftime("%H:%M")
            best = Floor(window["min_replicas"],
                         f"pre-warm window \"{window['schedule']}\" {window['timezone']} until {closes}")
    return best


def open_windows(windows: list[dict], now: datetime) -> list[dict]:
    """The windows open at `now`."""
    return [window for window in windows or [] if _opened_at(window, now) is not None]


def keep_warm_floor(keep_warm_s: int, last_cold_start_at: datetime | None, now: datetime) -> Floor:
    if not keep_warm_s or last_cold_start_at is None:
        return Floor(0, "")
    left = keep_warm_s - (now - last_cold_start_at).total_seconds()
    if left <= 0:
        return Floor(0, "")
    return Floor(1, f"kept warm {left:.0f} s more after a cold start")


def next_openings(windows: list[dict], now: datetime) -> list[tuple[dict, datetime | None]]:
    """When each window next opens, in its own time zone (for the console), soonest first; None, last,
    for a window that never opens (a date that never comes, stored before such schedules were refused)."""
    upcoming = []
    for window in windows or []:
        try:
            opens = None if len(window["schedule"]) > MAX_SCHEDULE_CHARS else croniter(
                window["schedule"], now.astimezone(zoneinfo.ZoneInfo(window["timezone"]))).get_next(datetime)
        except CroniterBadDateError:
            opens = None
        upcoming.append((window, opens))
    return sorted(upcoming, key=lambda pair: (pair[1] is None, pair[1] or now))


def _opened_at(window: dict, now: datetime) -> datetime | None:
    """When the window last opened, if it is still open at `now`."""
    if len(window["schedule"]) > MAX_SCHEDULE_CHARS:  # stored before they were refused: never read
        return None
    zone = zoneinfo.ZoneInfo(window["timezone"])
    local_now = now.astimezone(zone)
    try:
        # NOTE: a little after `now`, so a window opening exactly now counts as open.
        last = croniter(window["schedule"], local_now + timedelta(seconds=1)).get_prev(datetime)
    except CroniterBadDateError:
        # NOTE: a date that never comes (30 February) never opens; it must not stop the autoscaler's tick.
        return None
    if local_now - last < timedelta(minutes=window["duration_minutes"]):
        return last
    return None


def _valid_cron(schedule: str) -> bool:
    try:
        croniter(schedule, PROBE_AT)
    except (CroniterBadCronError, ValueError, KeyError):
        return False
    return croniter.is_valid(schedule)


def _occurs(schedule: str) -> bool:
    """Whether a valid schedule ever comes: croniter accepts `0 9 30 2 *` and only fails to find its dates."""
    try:
        croniter(schedule, PROBE_AT).get_next(datetime)
        croniter(schedule, PROBE_AT).get_prev(datetime)
    except CroniterBadDateError:
        return False
    return True


@functools.cache
def _timezones() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())
