"""The project's own system checks (`controlplane.checks`): settings that pass one by one but not together."""

from __future__ import annotations

import os
import subprocess
import sys

from django.core import checks

from tests.conftest import REPO_ROOT

MiB = 2**20


def _errors() -> list[checks.CheckMessage]:
    return [message for message in checks.run_checks() if message.id == "inferplane.E001"]


def test_a_per_organisation_answer_bound_at_or_past_the_process_bound_is_an_error(settings):
    # Before: 128 MiB an organisation against 96 MiB a process, the defaults, and nothing said so.
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 96 * MiB
    for per_org in (128 * MiB, 96 * MiB):
        settings.GATEWAY_ANSWER_BYTES_PER_ORG = per_org
        [error] = _errors()
        assert error.level == checks.ERROR
        assert f"INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG ({per_org} bytes) is not below" in error.msg
        assert str(24 * MiB) in error.hint
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 96 * MiB - 1
    assert _errors() == []


def _bounds(**env: str) -> tuple[int, int]:
    """The gateway's answer bounds as the project's settings read them from the environment: neither set, but as
    given."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name
        not in ("INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG", "INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS")
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from controlplane import settings as s; "
            "print(s.GATEWAY_ANSWER_BYTES_PER_ORG, s.GATEWAY_ANSWER_BYTES_PER_PROCESS)",
        ],
        cwd=REPO_ROOT,
        env=environment | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    per_org, per_process = result.stdout.split()
    return int(per_org), int(per_process)


def test_the_default_per_organisation_answer_bound_is_a_quarter_of_the_process_bound():
    """One organisation's answers take at most a fair share of a gateway process's, not all of it
    (`tests/gateway/test_slow_clients.py` shows another organisation served meanwhile)."""
    assert _bounds() == (24 * MiB, 96 * MiB)
    assert _bounds(INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS=str(32 * MiB)) == (8 * MiB, 32 * MiB)


def test_a_drain_that_leaves_the_steps_after_it_no_room_in_the_grace_period_is_a_warning(settings):
    # Before (the sixth review of the gateway's stop): a grace period of 50 s with the default 100 s drain cut every
    # call in flight at the signal, and nothing said so before the first stop.
    settings.GATEWAY_DRAIN_S, settings.GATEWAY_STOP_GRACE_S = 100, 50
    [warning] = [message for message in checks.run_checks() if message.id == "inferplane.W002"]
    assert warning.level == checks.WARNING
    assert "every stop's drain will wait 0 s" in warning.msg
    settings.GATEWAY_STOP_GRACE_S = 160  # the manifests': 160 - 3 - 10 - 45 = 102 >= 100
    assert [message for message in checks.run_checks() if message.id == "inferplane.W002"] == []
    settings.GATEWAY_STOP_GRACE_S = 0  # not known: nothing to say
    assert [message for message in checks.run_checks() if message.id == "inferplane.W002"] == []
