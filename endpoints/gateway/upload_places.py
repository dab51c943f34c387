"""A gateway process's upload places: the uploads whose bodies it reads or stores now, shared fairly between
organisations. Every upload a process takes in holds one from before its body is read until Django has returned, its body's file closed:
`POST /v1/files` and the console's batch form alike (`Gateway._upload`, `Gateway._console_upload`).

They are the process's own, not Redis's: what they bound is this process's share of the web pod's `/tmp` volume
(Django spools a body whole before any view runs), which tests/infra/test_manifests.py sizes to
`FILES_UPLOADS_PER_PROCESS` × `FILES_MAX_BYTES` per process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from django.conf import settings

from endpoints.gateway import errors

RETRY_AFTER_S = 5  # an upload refused while its process reads as many as it may
# The longest an upload waits for a place whose upload Django has answered but not yet closed (`UploadPlaces.take`):
# its temporary file and response are closed within milliseconds of the answer, unless the process's thread for
# Django's synchronous work is busy.
CLOSING_WAIT_S = 5
# The scope key under which the gateway hands Django the refusal of a console upload (its body dropped), for the
# form to say why (`refusal_in`).
REFUSAL_SCOPE_KEY = "inferplane.upload_refusal"
# What a multipart body adds to its file (boundaries, part headers, the other fields) at most: a body declaring more
# than a size limit plus this is refused before it is read (the gateway and `endpoints.batches.api` alike; the view
# still holds the file itself to the limit).
MULTIPART_OVERHEAD_BYTES = 64 * 1024


@dataclass(eq=False)
class Place:
    """One upload's place, from `UploadPlaces.take` to `UploadPlaces.give_back`."""

    organization_id: int
    answered: bool = False  # Django has sent its answer's last byte; its body's file may still be on the disk


class UploadPlaces:
    """The places of one process. `take` one before an upload's body is read; mark it `answered` as Django sends its
    answer's last byte; `give_back` it once Django has returned (its body's temporary file closed), on every way out.

    NOTE: counted on the event loop only, with no await between the last check and the count: two uploads cannot both
    take the last place, and no lock is needed."""

    def __init__(self):
        self.num_taken = 0
        self._taken_by_organization: Counter[int] = Counter()
        self._num_answered = 0  # places answered and not yet given back
        self._given_back: asyncio.Event | None = None  # set on the next `give_back`, for a `take` that waits for one

    async def take(self, organization_id: int) -> Place:
        """A place for an upload of the organisation; or a refusal (429) when this process reads as many as it may,
        or when the last place is free but the organisation already reads one here.

        A refusal that a place already answered would lift waits up to `CLOSING_WAIT_S` for it to be given back.

        NOTE: one organisation took every place: two uploads dripped a byte a second refused every other tenant's
        uploads on the process. Now it holds all but the last (one of the default two), and a slow body is cut
        (`app._BodyCut`).

        NOTE: Django closes an upload's body file after its answer's last byte is sent: a client that sent its next
        upload as soon as it read the answer (the openai client's `files.create` twice) was refused now and then, its
        own previous upload still counted (a CI run's failure, tests/batches/test_idempotency_keys.py)."""
        loop, deadline = asyncio.get_running_loop(), None
        while (refusal := self._refusal(organization_id)) is not None:
            deadline = deadline or loop.time() + CLOSING_WAIT_S
            if not self._num_answered or loop.time() >= deadline:
                raise refusal
            if self._given_back is None:
                self._given_back = asyncio.Event()
            try:
                await asyncio.wait_for(self._given_back.wait(), deadline - loop.time())
            except TimeoutError:
                raise refusal from None
        self.num_taken += 1
        self._taken_by_organization[organization_id] += 1
        return Place(organization_id)

    def _refusal(self, organization_id: int) -> errors.OpenAIError | None:
        num_free = settings.FILES_UPLOADS_PER_PROCESS - self.num_taken
        if num_free <= 0:
            return errors.rate_limited(
                "Too many uploads in progress on this server: try again in a few seconds.", RETRY_AFTER_S
            )
        if (
            num_free == 1
            and self._taken_by_organization[organization_id]
            and settings.FILES_UPLOADS_PER_PROCESS > 1
        ):
            return errors.rate_limited(
                "Your organisation already has an upload in progress on this server, whose last "
                "place is kept for others: try again once it ends.",
                RETRY_AFTER_S,
            )
        return None

    def answered(self, place: Place) -> None:
        if not place.answered:
            place.answered = True
            self._num_answered += 1

    def give_back(self, place: Place) -> None:
        self.num_taken -= 1
        self._num_answered -= place.answered
        self._taken_by_organization[place.organization_id] -= 1
        if not self._taken_by_organization[place.organization_id]:
            del self._taken_by_organization[place.organization_id]
        if self._given_back is not None:
            self._given_back.set()
            self._given_back = None


def refusal_in(scope: Mapping) -> errors.OpenAIError | None:
    """Why the gateway refused the console upload of a request, whose `scope` is its ASGI scope (a WSGI request has
    none: `{}`); None when it did not."""
    return scope.get(REFUSAL_SCOPE_KEY)
