"""A gateway process's upload places: the uploads whose bodies it reads or stores now, shared fairly between
organisations. Every upload a process takes in holds one from before its body is read until Django has answered:
`POST /v1/files` and the console's batch form alike (`Gateway._upload`, `Gateway._console_upload`).

They are the process's own, not Redis's: what they bound is this process's share of the web pod's `/tmp` volume
(Django spools a body whole before any view runs), which tests/infra/test_manifests.py sizes to
`FILES_UPLOADS_PER_PROCESS` × `FILES_MAX_BYTES` per process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from django.conf import settings

from endpoints.gateway import errors

RETRY_AFTER_S = 5  # an upload refused while its process reads as many as it may
# The scope key under which the gateway hands Django the refusal of a console upload (its body dropped), for the
# form to say why (`refusal_in`).
REFUSAL_SCOPE_KEY = "inferplane.upload_refusal"


class UploadPlaces:
    """The places of one process. `take` one before an upload's body is read; `give_back` it once Django answered,
    on every way out.

    NOTE: taken and given back on the event loop only, with no await between the check and the count: two uploads
    cannot both take the last place, and no lock is needed."""

    def __init__(self):
        self.num_taken = 0
        self._taken_by_organization: Counter[int] = Counter()

    def take(self, organization_id: int) -> None:
        """Count an upload of the organisation in, or refuse it (429) when this process reads as many as it may, or
        when the last place is free but the organisation already reads one here.

        NOTE: one organisation took every place: two uploads dripped a byte a second refused every other tenant's
        uploads on the process. Now it holds all but the last (one of the default two), and a slow body is cut
        (`app._BodyCut`)."""
        num_free = settings.FILES_UPLOADS_PER_PROCESS - self.num_taken
        if num_free <= 0:
            raise errors.rate_limited(
                "Too many uploads in progress on this server: try again in a few seconds.", RETRY_AFTER_S
            )
        if (
            num_free == 1
            and self._taken_by_organization[organization_id]
            and settings.FILES_UPLOADS_PER_PROCESS > 1
        ):
            raise errors.rate_limited(
                "Your organisation already has an upload in progress on this server, whose last "
                "place is kept for others: try again once it ends.",
                RETRY_AFTER_S,
            )
        self.num_taken += 1
        self._taken_by_organization[organization_id] += 1

    def give_back(self, organization_id: int) -> None:
        self.num_taken -= 1
        self._taken_by_organization[organization_id] -= 1
        if not self._taken_by_organization[organization_id]:
            del self._taken_by_organization[organization_id]


def refusal_in(scope: Mapping) -> errors.OpenAIError | None:
    """Why the gateway refused the console upload of a request, whose `scope` is its ASGI scope (a WSGI request has
    none: `{}`); None when it did not."""
    return scope.get(REFUSAL_SCOPE_KEY)
