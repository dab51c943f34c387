"""The extra agent flags a pool template may ask for, from an allow-list.

NOTE: a template is staff input, and the flags become a process's argv (local) or a line of a
machine's boot script (EC2): only flags named here, with values of the expected shape, ever pass, so
a template can never add `--control-plane`, `--join-token` or anything the agent does not know.
"""

from __future__ import annotations

_SWITCHES = frozenset({"--no-standby", "--no-zygote"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _whole(low: int, high: int):
    def check(text: str) -> str | None:
        if not text.isdigit() or not low <= int(text) <= high:
            return f"a whole number from {low} to {high}"
        return None

    return check


def _gigabytes(text: str) -> str | None:
    try:
        number = float(text)
    except ValueError:
        return "a number of gigabytes"
    return None if 0 < number <= 1_000_000 else "a number of gigabytes above 0"


def _log_level(text: str) -> str | None:
    return None if text in _LOG_LEVELS else f"one of {', '.join(_LOG_LEVELS)}"


# flag -> check of its value (None: a valid value, else what it must be)
_VALUED = {
    "--cpu-kv-cache-gib": _whole(1, 1024),
    "--weights-budget-gb": _gigabytes,
    "--log-level": _log_level,
}
ALLOWED_FLAGS = tuple(sorted(_SWITCHES | set(_VALUED)))


def _pairs(value) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(flag, value) pairs of `value` ("--flag N", "--flag=N" or "--flag" "N"), and what is wrong with it."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        return [], ["A list of agent flags (strings)."]
    pairs: list[tuple[str, str | None]] = []
    errors: list[str] = []
    items = list(value)
    while items:
        flag, _, inline = items.pop(0).strip().partition("=")
        if flag in _SWITCHES and not inline:
            pairs.append((flag, None))
        elif flag in _VALUED:
            argument = inline or (items.pop(0).strip() if items else "")
            problem = _VALUED[flag](argument)
            if problem:
                errors.append(f"{flag} takes {problem}.")
            else:
                pairs.append((flag, argument))
        else:
            errors.append(f"{flag!r} is not an allowed agent flag (allowed: {', '.join(ALLOWED_FLAGS)}).")
    return pairs, errors


def agent_args_errors(value) -> list[str]:
    """What is wrong with a template's `agent_args` ([] when valid)."""
    return _pairs(value)[1]


def agent_argv(value) -> list[str]:
    """The validated flags as argv items (`["--cpu-kv-cache-gib", "2"]`); raises ValueError when invalid."""
    pairs, errors = _pairs(value or [])
    if errors:
        raise ValueError(" ".join(errors))
    argv: list[str] = []
    for flag, argument in pairs:
        argv += [flag] if argument is None else [flag, argument]
    return argv
