"""Celery's broker transport: kombu's Redis transport, made to outlive Redis restarts with tasks held by the worker.

Two faults of kombu's Redis transport (5.7) when Redis goes away under a worker that holds unacknowledged messages
(a task running, or one with a countdown waiting in the worker), both found when the embedded Redis restarted under
`make run`:

- Celery's consumer first `collect()`s the broken connection, which unlinks the transport from it
  (`transport.client = None`), and then closes it; closing the default channel hands the held messages back to the
  queue (`QoS.restore_unacked`) through a fresh Redis pool, whose parameters kombu reads from `transport.client`:
  `AttributeError: 'NoneType' object has no attribute 'hostname'`, which neither kombu nor Celery ignore, and the
  worker exits. The channel keeps the connection it was opened on and reads the parameters from it instead.
- That hand-back runs while Redis is still down, so it fails; the messages stay in the broker's unacknowledged set
  until the visibility timeout (an hour) passes. The worker remembers their delivery tags and hands them back on
  its next channel, once Redis answers again (their bodies are in Redis, kept across its restart), each only while
  its unacknowledged copy is still the one this process held: a message handed back keeps its delivery tag, and a
  copy delivered again since (to another worker, or after the visibility timeout) is indexed at a later time. A
  process forked after the failure (billiard's new pool child) forgets them: its parent hands them back.

NOTE: a review found that without those two rules a remembered tag handed back by a forked child (or twice) took the
message from the consumer that held it again and queued it a second time: the task ran twice.

A third, the same rule for a channel's own acknowledgement: kombu's ack (and reject, and the hand-back of a closing
channel) deletes the tag's unacknowledged entry whichever copy it is. A task that ran on through a Redis restart
(`acks_late`) acked on its old channel after its message had been handed back and delivered again with the same tag:
its ack deleted the new holder's entry, and that copy, no longer recorded, was lost if its worker died or Redis
restarted in turn (reproduced, `tests/test_broker_transport.py`); so did a task that outlived the visibility timeout.
Each channel remembers when it delivered each message and settles its entry only while it is still that copy."""

import os
import time

from kombu.transport import redis, virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

# NOTE: per process: the delivery tags whose hand-back failed on a lost connection, with when it failed. Only this
# process held them (a message is delivered to one consumer), so no other worker hands them back before the
# visibility timeout.
_tags_to_restore: dict[str, float] = {}
os.register_at_fork(after_in_child=_tags_to_restore.clear)


class QoS(redis.QoS):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # NOTE: per delivery tag, the score this channel wrote in the unacknowledged index.
        self._delivered_at: dict[str, float] = {}

    def append(self, message, delivery_tag):
        """kombu's, the delivery's time kept: the mark of the copy this channel holds."""
        delivered_at = time.time()
        delivery = message.delivery_info
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: delivered_at}).hset(
                self.unacked_key,
                delivery_tag,
                dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),
            ).execute()
        self._delivered_at[delivery_tag] = delivered_at
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag):
        self._settle(delivery_tag, requeue=False)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag, requeue=False):
        self._settle(delivery_tag, requeue=requeue, leftmost=True)
        virtual.QoS.ack(self, delivery_tag)

    def restore_by_tag(self, tag, client=None, leftmost=False):
        self._settle(tag, requeue=True, client=client, leftmost=leftmost)

    def _settle(self, tag: str, *, requeue: bool, client=None, leftmost: bool = False) -> None:
        """Drop `tag`'s unacknowledged entry, its message queued again if `requeue`, only while it is the copy this
        channel delivered (any copy for a tag it never delivered: kombu's visibility-timeout restore). One transaction
        over both indices."""
        channel, delivered_at = self.channel, self._delivered_at.get(tag)

        def settle(pipe):
            held_at = pipe.zscore(channel.unacked_index_key, tag)
            payload = pipe.hget(channel.unacked_key, tag) if requeue else None
            pipe.multi()
            if held_at is None or (delivered_at is not None and held_at != delivered_at):
                return  # settled already, or delivered again since: another holder's entry
            self._remove_from_indices(tag, pipe)
            if payload:
                message, exchange, routing_key = loads(bytes_to_str(payload))
                channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

        with channel.conn_or_acquire(client) as client:
            client.transaction(settle, channel.unacked_key, channel.unacked_index_key)
        # NOTE: kept when Redis was out of reach (raised above): a later ack still needs it.
        self._delivered_at.pop(tag, None)

    def restore_unacked(self, client=None):
        tags = set(self._delivered)
        try:
            return super().restore_unacked(client)
        except self.channel.connection_errors:
            failed_at = time.time()
            _tags_to_restore.update(dict.fromkeys(tags, failed_at))
            self._delivered.clear()
            raise

    def restore_if_still_held(self, tag: str, failed_at: float) -> None:
        """Hand `tag`'s message back to its queue if its unacknowledged copy was delivered before `failed_at` (the one
        this process held); a copy delivered since, or none, is left alone. One transaction over both indices."""
        channel = self.channel

        def restore(pipe):
            delivered_at = pipe.zscore(channel.unacked_index_key, tag)
            payload = pipe.hget(channel.unacked_key, tag)
            pipe.multi()
            if delivered_at is None or delivered_at > failed_at:
                return
            self._remove_from_indices(tag, pipe)
            if payload:
                message, exchange, routing_key = loads(bytes_to_str(payload))
                channel._do_restore_message(message, exchange, routing_key, pipe, False)

        with channel.conn_or_acquire() as client:
            client.transaction(restore, channel.unacked_key, channel.unacked_index_key)


class Channel(redis.Channel):
    QoS = QoS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._broker_connection = self.connection.client
        try:
            for tag, failed_at in list(_tags_to_restore.items()):
                self.qos.restore_if_still_held(tag, failed_at)
                del _tags_to_restore[tag]
        except BaseException:
            self.close()  # NOTE: not left in the connection's poller, its Redis pool open; the tags stay remembered
            raise

    def _connparams(self, asynchronous=False):
        transport = self.connection
        if transport.client is not None:
            return super()._connparams(asynchronous=asynchronous)
        # The transport was unlinked from its connection (see the module's docstring): lend it back for this read.
        transport.client = self._broker_connection
        try:
            return super()._connparams(asynchronous=asynchronous)
        finally:
            transport.client = None


class Transport(redis.Transport):
    Channel = Channel
