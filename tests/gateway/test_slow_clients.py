"""Clients that stop reading their answers (`endpoints.gateway.delivery`): cut off after the send deadline, and the
answers an organisation leaves unread in a gateway process bounded."""

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from billing.models import UsageRecord
from controlplane.accounts.keys import create_api_key
from controlplane.accounts.models import Role, Scope
from controlplane.accounts.services import Actor
from controlplane.redis_client import get_redis
from controlplane.redis_keys import reservations_key
from tests.conftest import start_web_server, wait_until
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory
from tests.gateway.conftest import serve_endpoint

pytestmark = pytest.mark.django_db(transaction=True)

ANSWER_BYTES = 24 * 2**20  # far past what the kernel's socket buffers take on loopback


@contextlib.contextmanager
def _unread_call(gateway_url: str, key: str, model: str, *, stream: bool = False, max_tokens: int = 5):
    """A chat call whose client sends its request and then reads nothing (a receive window of a few KiB)."""
    host, port = gateway_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    if stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
    body = json.dumps(payload).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def gateway_with(tmp_path, web_zygote):
    """`gateway_with(**env)`: a gateway started with these settings, stopped at the test's end (forked from the
    zygote of these settings: the first pays the imports, the next ones of the same settings fork)."""
    started = []

    def start(**env) -> str:
        child, base_url = start_web_server(tmp_path, name="gateway", extra_env=env, zygote=web_zygote)
        started.append(child)
        start.pid = child.pid
        return base_url

    yield start
    for child in started:
        child.stop()


def _read_to_end(sock: socket.socket, timeout_s: float = 20) -> bytes:
    sock.settimeout(timeout_s)
    received = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            received.append(chunk)
    return b"".join(received)


def test_a_client_that_reads_none_of_a_large_answer_is_cut_off_at_the_send_deadline_and_billed(
        tenant, start_mock_upstream, gateway_with):
    # Before, the whole answer went to the server's buffers and the call ended "ok" at once: the buffers stayed
    # the gateway's for as long as the client held its connection open, reading nothing.
    gateway = gateway_with(INFERPLANE_GATEWAY_SEND_TIMEOUT_S="2")
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=ANSWER_BYTES))
    with _unread_call(gateway, tenant.key, endpoint.name) as sock:
        row = wait_until(lambda: UsageRecord.objects.first(), 20, message="the usage row")
        assert row.status == "client_aborted"
        assert (row.prompt_tokens, row.completion_tokens) == (7, 5) and row.cost > 0  # the engine computed it
        received = _read_to_end(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert 0 < len(body) < ANSWER_BYTES  # dropped part-way: the rest was never the server's to hold
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")
    assert UsageRecord.objects.count() == 1


def test_a_stream_whose_client_stops_reading_is_cut_off_and_billed_for_what_it_was_sent(
        tenant, start_mock_upstream, gateway_with):
    # Before, the stream waited on its client for ever: its replica's engine request, its reservation and its usage
    # row all held for as long as the client kept its connection open.
    gateway = gateway_with(INFERPLANE_GATEWAY_SEND_TIMEOUT_S="2")
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=ANSWER_BYTES))
    with _unread_call(gateway, tenant.key, endpoint.name, stream=True, max_tokens=200) as sock:
        row = wait_until(lambda: UsageRecord.objects.first(), 20, message="the usage row")
        received = _read_to_end(sock)
    assert row.status == "client_aborted"
    assert 0 < row.completion_tokens < 200  # the events it was sent
    assert b"data: [DONE]" not in received
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")


def test_an_organisation_whose_clients_leave_answers_unread_is_refused_new_calls_and_others_are_not(
        tenant, start_mock_upstream, gateway_with):
    # (a call of the organisation admitted before the unread answer came waits behind it: at most the send deadline)
    gateway = gateway_with(INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG=str(4 * 2**20), INFERPLANE_GATEWAY_SEND_TIMEOUT_S="10")
    upstream = start_mock_upstream(whole_answer_bytes=ANSWER_BYTES)
    endpoint = serve_endpoint(tenant.org, upstream)
    other_org, other_user = OrganizationFactory(), UserFactory()
    MembershipFactory(organization=other_org, user=other_user, role=Role.OWNER)
    other_key = create_api_key(Actor(user=other_user), other_org, name="k", scopes=[Scope.INFERENCE]).plain
    other_endpoint = serve_endpoint(other_org, upstream)

    def call(key, model):
        return httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
                          timeout=60)

    with _unread_call(gateway, tenant.key, endpoint.name):
        wait_until(lambda: get_redis().hlen(reservations_key(tenant.org.pk)) == 1, 10, message="the unread call")
        time.sleep(1)  # its answer read from the replica (a local mock's, at once) and handed over in part
        refused = call(tenant.key, endpoint.name)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "unread_answers" and refused.headers["retry-after"]
        served = call(other_key, other_endpoint.name)  # another organisation's calls are not held up
        assert served.status_code == 200 and len(served.content) > ANSWER_BYTES // 2
    # its client gone, the organisation is served again
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the unread call to end")
    assert call(tenant.key, endpoint.name).status_code == 200


def test_a_stream_read_just_fast_enough_is_cut_off_before_its_reservation_lapses(tenant, start_mock_upstream, gateway_with):
    # The gateway holds a call's reservation up to the longest wait from its start, and it lapses one reservation
    # time later: a stream read slowly enough to run on past both went on with nothing held against the caps and
    # prepaid credit (hold many, let their holds lapse, start as many again). Here: 1 s, plus a third of 3 s.
    gateway = gateway_with(INFERPLANE_GATEWAY_MAX_ANSWER_WAIT_S="1", INFERPLANE_RESERVATION_TTL_S="3")
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(token_delay_ms=50))
    started, received = time.monotonic(), []
    with (pytest.raises(httpx.RemoteProtocolError),  # its connection dropped part-way
          httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                       json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                             "stream": True}, timeout=30) as response):
        for chunk in response.iter_bytes():
            received.append(chunk)
    assert time.monotonic() - started < 6  # 200 tokens take 10 s
    assert received and b"data: [DONE]" not in b"".join(received)
    row = wait_until(lambda: UsageRecord.objects.first(), 10, message="the usage row")
    assert row.status == "client_aborted" and 0 < row.completion_tokens < 200
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="the reservation settled")


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_answers_of_many_calls_sent_together_stay_near_the_organisations_bound(tenant, start_mock_upstream, gateway_with):
    # The bound was checked at a call's start only, and an answer counted once it was being sent: six calls sent
    # together were all admitted, and their answers, read at once, held six times an answer in the gateway.
    gateway = gateway_with(INFERPLANE_GATEWAY_ANSWER_BYTES_PER_ORG=str(8 * 2**20))
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=ANSWER_BYTES, prefill_ms=1500))
    before = _rss_bytes(gateway_with.pid)
    with contextlib.ExitStack() as unread:
        for _ in range(6):
            unread.enter_context(_unread_call(gateway, tenant.key, endpoint.name))
        wait_until(lambda: get_redis().hlen(reservations_key(tenant.org.pk)) == 6, 10, message="six calls admitted")
        time.sleep(4)  # every answer came: one read whole and sent in part, the others wait in the engine
        grown = _rss_bytes(gateway_with.pid) - before
        refused = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                             json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert grown < 3 * ANSWER_BYTES, f"the gateway grew by {grown // 2**20} MiB"  # six answers: 144 MiB and more
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "unread_answers"
    # its clients gone, every call ends and the organisation is served again
    wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 20, message="the unread calls to end")
    served = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {tenant.key}"},
                        json={"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert served.status_code == 200 and len(served.content) > ANSWER_BYTES // 2


def _organisation(upstream: str) -> tuple[str, str, int]:
    """Another organisation with an inference key and an endpoint on `upstream`: (key, model, organisation id)."""
    organization, user = OrganizationFactory(), UserFactory()
    MembershipFactory(organization=organization, user=user, role=Role.OWNER)
    key = create_api_key(Actor(user=user), organization, name="k", scopes=[Scope.INFERENCE]).plain
    return key, serve_endpoint(organization, upstream).name, organization.pk


def test_many_organisations_each_within_their_own_bound_are_held_together_to_the_process_bound(
        tenant, start_mock_upstream, gateway_with):
    # Sign-up is open, and the bound was per organisation only: five organisations' unread answers, each within its
    # own bound (128 MiB), were all read into the gateway at once (120 MiB and more; forty such held 5 GiB in a pod of
    # 1 GiB). Past the process's bound they wait in their engines, and an organisation holding nothing is not refused
    # for what the others hold: its answer waits its turn.
    gateway = gateway_with(INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS=str(8 * 2**20))
    upstream = start_mock_upstream(whole_answer_bytes=ANSWER_BYTES, prefill_ms=1500)
    unread = [_organisation(upstream) for _ in range(5)]
    fresh_key, fresh_model, fresh_id = _organisation(upstream)
    before = _rss_bytes(gateway_with.pid)
    fresh = {}

    def call_fresh():
        fresh["answer"] = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {fresh_key}"},
                                     json={"model": fresh_model, "messages": [{"role": "user", "content": "Hi"}]},
                                     timeout=60)

    with contextlib.ExitStack() as calls:
        for key, model, _ in unread:
            calls.enter_context(_unread_call(gateway, key, model))
        wait_until(lambda: all(get_redis().hlen(reservations_key(org_id)) == 1 for _, _, org_id in unread), 10,
                   message="five calls admitted")
        time.sleep(4)  # every answer came: one read whole and sent in part, the others wait in their engines
        grown = _rss_bytes(gateway_with.pid) - before
        caller = threading.Thread(target=call_fresh)
        caller.start()
        wait_until(lambda: get_redis().hlen(reservations_key(fresh_id)) == 1, 10, message="the fresh call admitted")
    assert grown < 3 * ANSWER_BYTES, f"the gateway grew by {grown // 2**20} MiB"  # five answers: 120 MiB and more
    # their clients gone, the answers waiting go on in turn; the fresh organisation's is served whole
    caller.join(60)
    assert fresh["answer"].status_code == 200, fresh["answer"].text
    assert len(fresh["answer"].content) > ANSWER_BYTES // 2
    wait_until(lambda: not any(get_redis().hlen(reservations_key(org_id)) for _, _, org_id in unread), 20,
               message="the unread calls to end")
    # Nothing of theirs is left counted: each is served whole. NOTE: their calls are sent together, each organisation's
    # one call admitted at once (it holds nothing: a count left behind would refuse it, 429, together or alone), their
    # answers then read in turn: one after another, each waited out the engine's prefill (1.5 s) again.
    def call(key: str, model: str) -> httpx.Response:
        return httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)

    with ThreadPoolExecutor(len(unread)) as pool:
        served = list(pool.map(call, [key for key, _, _ in unread], [model for _, model, _ in unread]))
    for answer in served:
        assert answer.status_code == 200 and len(answer.content) > ANSWER_BYTES // 2, answer.status_code


def test_by_default_one_organisations_unread_answers_leave_the_process_to_the_others(
        tenant, start_mock_upstream, gateway_with):
    # The organisation's bound was 128 MiB by default, above the process's 96: it never acted first, and one
    # organisation's unread answers took the process's whole budget, another organisation's answer waiting behind
    # them until the send deadline (60 s). Its bound is a share of the process's now (here 8 MiB of 32).
    gateway = gateway_with(INFERPLANE_GATEWAY_ANSWER_BYTES_PER_PROCESS=str(32 * 2**20))
    upstream = start_mock_upstream(whole_answer_bytes=ANSWER_BYTES, prefill_ms=1500)
    endpoint = serve_endpoint(tenant.org, upstream)
    other_key, other_model, _ = _organisation(upstream)
    with contextlib.ExitStack() as unread:
        for _ in range(4):
            unread.enter_context(_unread_call(gateway, tenant.key, endpoint.name))
        wait_until(lambda: get_redis().hlen(reservations_key(tenant.org.pk)) == 4, 10, message="four calls admitted")
        time.sleep(4)  # every answer came: the organisation's first read whole and sent in part, the others waiting
        started = time.monotonic()
        try:
            served = httpx.post(f"{gateway}/v1/chat/completions", headers={"authorization": f"Bearer {other_key}"},
                                json={"model": other_model, "messages": [{"role": "user", "content": "Hi"}]},
                                timeout=20)
        except httpx.TimeoutException:
            pytest.fail("another organisation's answer waited behind the unread answers of one")
        waited_s = time.monotonic() - started
    assert served.status_code == 200, served.text
    assert len(served.content) > ANSWER_BYTES // 2 and waited_s < 10


def test_a_call_on_a_kept_alive_connection_whose_last_answer_is_unread_is_cut_off_not_held(
        tenant, start_mock_upstream, gateway_with):
    # Answers small enough to go out in one write were sent unwatched: once the server's buffer for the connection
    # was full of answers its client had not read, the next call's first send waited for as long as the client kept
    # the connection, holding its replica and its reservation.
    gateway = gateway_with(INFERPLANE_GATEWAY_SEND_TIMEOUT_S="2")
    endpoint = serve_endpoint(tenant.org, start_mock_upstream(whole_answer_bytes=200 * 1024))
    host, port = gateway.removeprefix("http://").split(":")
    body = json.dumps({"model": endpoint.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"authorization: Bearer {tenant.key}\r\ncontent-length: {len(body)}\r\n\r\n{body}").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(request * 40)  # one after another on the one connection, none of their answers read
        wait_until(lambda: UsageRecord.objects.filter(status="client_aborted").exists(), 30,
                   message="the call whose first send waited to be cut off")
        wait_until(lambda: not get_redis().hlen(reservations_key(tenant.org.pk)), 10, message="no call held")
    finally:
        sock.close()
