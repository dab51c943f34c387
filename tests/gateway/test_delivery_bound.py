"""`delivery.Holding`: what an organisation's whole answers, and every organisation's together, hold in a process.
Simulated without servers (the connections are fakes that read a piece whenever they are not paused), then read from
a replica on a real socket (`upstream`) as `InferenceCall` reads them, on every way a call ends."""

import asyncio

import pytest

from endpoints.gateway import delivery, errors, upstream
from tests.gateway.test_upstream_client import Server, _read_request, run

MiB = 2**20
PIECE = 256 * 1024


class _Connection:
    def __init__(self, organization_id: int, size: int):
        self.holding, self.left, self.size = delivery.Holding(organization_id), size, size
        self.organization_id = organization_id
        self.paused = self.closed = False
        self.finished_at: int | None = None  # the turn its read ended

    def resume(self) -> None:
        self.paused = False


def _run(connections, *, clients_read: bool, arrivals: dict | None = None) -> int:
    """Reads every connection to its end, round robin; a finished answer is taken by its client at once (or never).
    `arrivals`: the connections that join at a turn ({turn: [...]}). Returns the most the process held."""
    connections, arrivals = list(connections), dict(arrivals or {})
    organization_ids = {c.organization_id for c in [*connections, *(c for a in arrivals.values() for c in a)]}
    peak = 0
    for turn in range(100_000):
        connections += arrivals.pop(turn, [])
        reading = [c for c in connections if c.left]
        if not reading and not arrivals:
            return peak
        if reading and all(c.paused for c in reading):
            raise AssertionError("every answer is paused: nothing moves")
        for connection in reading:
            if connection.paused:
                continue
            piece = min(PIECE, connection.left)
            connection.left -= piece
            if connection.holding.take(piece, connection):
                connection.paused = True
            if not connection.left:
                connection.finished_at = turn
                connection.holding.done_reading()
                if clients_read:
                    connection.holding.close()
            peak = max(peak, _held(organization_ids))
    raise AssertionError("never finished")


def _held(organization_ids) -> int:
    """What these organisations' answers hold in the process, together."""
    return sum(delivery.held_bytes(organization_id) for organization_id in organization_ids)


def _assert_nothing_held() -> None:
    """Every count back at zero and every slot free: nothing counted twice, nothing left behind."""
    outbox = delivery._outboxes.get()
    process = outbox.process
    assert (process.held, process.waiting, process.num_parked, process.num_orgs, process.reader) == (0, 0, 0, 0, None)
    for organization_id, share in outbox.shares.items():
        assert (share.held, share.reading, share.num_answers, share.reader) == (0, 0, 0, None), organization_id


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
        for connection in stuck:  # the send deadline cuts off those being sent: their bytes given back
            if not connection.left:
                connection.holding.close()
        assert sum(not c.paused for c in stuck if c.left) >= 1  # the next goes on
        _run(stuck, clients_read=True)
        assert delivery.held_bytes(1) == 0

    asyncio.run(main())


def test_many_organisations_each_within_their_own_bound_are_held_together_to_the_process_bound(settings):
    # Sign-up is open: forty organisations (one tenant's, or many tenants' at once) each held an answer within its own
    # bound, and the process held all of them at once, 240 MiB here against a process bound of 16 (40 x 128 MiB with
    # the defaults, in a pod of 1 GiB).
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 8 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 16 * MiB

    async def main():
        connections = [_Connection(organization_id, 6 * MiB) for organization_id in range(1, 41)]
        peak = _run(connections, clients_read=True)
        # twice the bound, one answer and a first piece of each answer being read
        assert peak <= 2 * 16 * MiB + 6 * MiB + 40 * PIECE, peak // MiB
        assert all(c.finished_at is not None for c in connections)
        _assert_nothing_held()

    asyncio.run(main())


def test_answers_unread_by_many_organisations_pause_the_rest_until_their_clients_are_cut_off(settings):
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 8 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 16 * MiB

    async def main():
        stuck = [_Connection(organization_id, 6 * MiB) for organization_id in range(1, 41)]
        with pytest.raises(AssertionError, match="nothing moves"):
            _run(stuck, clients_read=False)
        assert _held(range(1, 41)) <= 2 * 16 * MiB + 6 * MiB + 40 * PIECE
        assert all(delivery.held_bytes(c.organization_id) < 8 * MiB for c in stuck)  # each within its own bound
        for connection in stuck:  # the send deadline cuts off those being sent: their bytes given back
            if not connection.left:
                connection.holding.close()
        assert sum(not c.paused for c in stuck if c.left) >= 1  # the next goes on
        _run(stuck, clients_read=True)
        _assert_nothing_held()

    asyncio.run(main())


def test_paused_answers_go_on_organisations_in_turn_so_none_waits_behind_anothers_many(settings):
    # Past the process's bound, oldest first would keep an organisation's one paused answer waiting behind all thirty
    # of another's; organisations in turn, it goes on within a turn or two of the process having room.
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 512 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 8 * MiB

    async def main():
        many = [_Connection(1, 4 * MiB) for _ in range(30)]
        one = _Connection(2, 4 * MiB)
        _run(many, clients_read=True, arrivals={3: [one]})
        finished_before = sum(c.finished_at < one.finished_at for c in many)
        assert finished_before <= 6, finished_before
        _assert_nothing_held()

    asyncio.run(main())


def test_a_call_is_refused_for_the_process_only_to_an_organisation_holding_an_equal_share_of_it_or_more(settings):
    # An organisation within its own bound is not refused for what others hold: its answers wait their turn. One that
    # holds an equal share of a process past its bound, or more, is: it fills the process itself.
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 64 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 8 * MiB

    async def main():
        large, small = _Connection(1, 6 * MiB), _Connection(2, MiB // 2)
        waiting = _Connection(3, MiB)  # its answer has not come yet: it holds nothing
        _run([large, small], clients_read=False)
        for organization_id in (1, 2, 3):
            delivery.refuse_if_over(organization_id)  # 6.5 MiB: the process is within its bound
        more = _Connection(2, 2 * MiB)
        _run([more], clients_read=False)  # 8.5 MiB: past it
        with pytest.raises(errors.OpenAIError) as refused:
            delivery.refuse_if_over(1)  # 6 MiB of 8.5, with three organisations' answers open
        assert refused.value.status == 429 and refused.value.code == delivery.UNREAD_ANSWERS
        assert "holds 8 MiB" in refused.value.message and refused.value.headers["retry-after"]
        delivery.refuse_if_over(2)  # 2.5 MiB of 8.5: less than an equal share
        delivery.refuse_if_over(3)
        delivery.refuse_if_over(4)  # none open
        for connection in (large, small, waiting, more):
            connection.holding.close()
        _assert_nothing_held()

    asyncio.run(main())


def test_a_piece_parsed_after_its_connection_paused_leaves_the_answer_paused_once(settings):
    # A chunked answer's chunks read at once are parsed one by one after the first paused the connection: each was
    # counted as a pause of its own, and the count of paused answers never came back to zero.
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 64 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 1 * MiB

    async def main():
        first, second = _Connection(1, 2 * MiB), _Connection(2, 2 * MiB)
        first.holding.take(2 * MiB, first)  # read whole: the process's reader
        assert second.holding.take(PIECE, second) and second.holding.take(PIECE, second)
        second.paused, second.left = True, 2 * MiB - 2 * PIECE
        first.holding.done_reading()
        first.holding.close()  # its client took it: the other goes on
        assert not second.paused
        _run([second], clients_read=True)
        _assert_nothing_held()

    asyncio.run(main())


ANSWER = 8 * MiB


async def _replica(reader, writer, server):
    """Answers each request with a whole answer of ANSWER bytes; on `/fail`, half of one, and then it is gone."""
    while True:
        request = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % ANSWER)
        if request.startswith(b"POST /fail "):
            writer.write(b"x" * (ANSWER // 2))
            await writer.drain()
            return
        writer.write(b"x" * ANSWER)
        await writer.drain()


async def _call(client, address: str, organization_id: int, ending: str) -> None:
    """A whole answer read and handed over as `InferenceCall` does, ended one of the ways a call ends."""
    holding = delivery.Holding(organization_id)
    response = None
    try:
        response = await client.post(address, "/fail" if ending == "upstream error" else "/", b"{}", {})
        try:
            body = await response.read(holding=holding)
        finally:
            holding.done_reading()
        if ending == "client gone":  # read on to its end for its usage: nobody to send it to
            return
        for start in range(0, len(body), delivery.PIECE_BYTES):
            await asyncio.sleep(0.002)  # the client takes a piece
            holding.give(min(delivery.PIECE_BYTES, len(body) - start))
            if ending == "send timeout":  # it took one piece, then nothing: cut off
                return
    except upstream.UpstreamError:
        assert ending == "upstream error"
    finally:
        if response is not None:
            response.close()
        holding.close()


@pytest.mark.parametrize("ending", ["normal end", "client gone", "send timeout", "cut off while reading",
                                    "upstream error"])
def test_answers_read_from_replicas_by_many_organisations_stay_near_the_process_bound_and_leave_nothing_held(
        settings, ending):
    # Twenty organisations, each far within its own bound, read their answers from a replica at once: the process held
    # all of them (160 MiB against a bound of 4). Half the calls end normally, half the way named; after every way,
    # every count is back at zero (nothing counted twice, no slot kept by a call that is gone, no answer left paused).
    settings.GATEWAY_ANSWER_BYTES_PER_ORG = 64 * MiB
    settings.GATEWAY_ANSWER_BYTES_PER_PROCESS = 4 * MiB

    async def main():
        async with Server(_replica) as server:
            client = upstream.UpstreamClient()
            peak = 0

            def measure():
                nonlocal peak
                peak = max(peak, _held(range(1, 21)))
                measuring.append(asyncio.get_running_loop().call_soon(measure))

            measuring = []
            measure()
            calls = [asyncio.ensure_future(_call(client, server.address, organization_id,
                                                 ending if organization_id % 2 else "normal end"))
                     for organization_id in range(1, 21)]
            if ending == "cut off while reading":
                await asyncio.sleep(0.05)
                for cut in calls[::2]:  # the watchdog cancels a call it cuts off, wherever it waits
                    cut.cancel()
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            measuring[-1].cancel()
            await client.close()
        # twice the bound, one answer and a first piece (up to the high-water mark and a read) of each answer
        assert peak <= 2 * 4 * MiB + ANSWER + 20 * 2 * upstream.HIGH_WATER_BYTES, peak // MiB
        _assert_nothing_held()

    run(main())
