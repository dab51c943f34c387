"""`delivery.Holding`: what an organisation's whole answers hold in a process, simulated without servers (the
connections are fakes that read a piece whenever they are not paused)."""

import asyncio

import pytest

from endpoints.gateway import delivery

MiB = 2**20
PIECE = 256 * 1024


class _Connection:
    def __init__(self, organization_id: int, size: int):
        self.holding, self.left, self.size = delivery.Holding(organization_id), size, size
        self.paused = self.closed = False

    def resume(self) -> None:
        self.paused = False


def _run(connections, *, clients_read: bool) -> int:
    """Reads every connection to its end, round robin; a finished answer is taken by its client at once (or never).
    Returns the most the organisation held."""
    peak = 0
    for _turn in range(100_000):
        reading = [c for c in connections if c.left]
        if not reading:
            return peak
        if all(c.paused for c in reading):
            raise AssertionError("every answer is paused: nothing moves")
        for connection in reading:
            if connection.paused:
                continue
            piece = min(PIECE, connection.left)
            connection.left -= piece
            if connection.holding.take(piece, connection):
                connection.paused = True
            if not connection.left:
                connection.holding.done_reading()
                if clients_read:
                    connection.holding.close()
            peak = max(peak, delivery.held_bytes(1))
    raise AssertionError("never finished")


def test_many_answers_read_at_once_stay_near_the_bound_and_all_finish(settings):
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 8 * MiB

    async def main():
        connections = [_Connection(1, 8 * MiB) for _ in range(100)]
        peak = _run(connections, clients_read=True)
        # each answer's first piece (read before its bytes are known), the bound, one answer: resuming every parked
        # answer whenever a slot freed had each read a piece more every time, 437 MiB in a review's simulation
        assert peak <= 100 * PIECE + 8 * MiB + 8 * MiB, peak // MiB
        assert delivery.held_bytes(1) == 0

    asyncio.run(main())


def test_answers_whose_clients_never_read_leave_the_rest_paused_until_they_are_given_back(settings):
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 8 * MiB

    async def main():
        stuck = [_Connection(1, 6 * MiB) for _ in range(3)]
        with pytest.raises(AssertionError, match="nothing moves"):
            _run(stuck, clients_read=False)
        # read while under the bound, then the answers read whole past it by one: twice the bound and an answer at most
        assert delivery.held_bytes(1) <= 2 * 8 * MiB + 6 * MiB
        assert delivery.held_bytes(2) == 0  # another organisation holds nothing of it
        for connection in stuck:  # the send deadline cuts them off: their bytes given back
            connection.holding.close()
        assert sum(not c.paused for c in stuck if c.left) >= 1  # the next goes on
        _run(stuck, clients_read=True)
        assert delivery.held_bytes(1) == 0

    asyncio.run(main())
