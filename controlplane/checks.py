"""The project's own system checks (`manage.py check`, and the commands that run them, `migrate` included): settings
that each pass their own validation (`controlplane.env`) but together undo what one of them is for."""

from __future__ import annotations

from django.conf import settings
from django.core import checks


@checks.register()
def answer_bytes_bounds(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """An organisation's bound on its whole answers in a gateway process must be below the process's own
    (`endpoints.gateway.delivery`): at or past it, the process's bound always acts first, and one organisation's
    answers take the process's whole budget from every other tenant."""
    per_org, per_process = settings.GATEWAY_ANSWER_BYTES_PER_ORG, settings.GATEWAY_ANSWER_BYTES_PER_PROCESS
    if per_org < per_process:
        return []
    return [
        checks.Error(
            f"INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG ({per_org} bytes) is not below "
            f"INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS ({per_process} bytes): the process's bound would always act "
            "first, and one organisation could take a gateway process's whole budget of answer bytes from every other.",
            hint=f"Set it to a share of the process's bound (by default a quarter: {per_process // 4}).",
            id="inferplane.E001",
        )
    ]
