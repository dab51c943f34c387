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
  its next channel, once Redis answers again (their bodies are in Redis, kept across its restart). A process forked
  after the failure (billiard's new pool child) forgets them: its parent hands them back.

A third, kombu's too: a message handed back to its queue (a closing channel's hand-back, a reject with requeue, the
visibility-timeout sweep, the remembered hand-back above) kept its delivery tag, and every settlement (ack, reject,
hand-back) deletes the tag's unacknowledged entry whichever copy holds it. A task that ran on through a Redis restart
or past the visibility timeout (`acks_late`) acked on its old channel after its message had been delivered again:
its ack deleted the new holder's entry, and that copy, no longer recorded, was lost if its worker died or Redis
restarted in turn; a stale hand-back took the copy another consumer held and queued it twice (the task ran twice).
Each copy handed back now gets a new delivery tag, so a tag's entry is only ever the copy delivered under it, and
settling a tag can touch no other copy (`tests/test_broker_transport.py`).

NOTE: a review found that marks of when each channel delivered each tag (the previous fix) were dropped by a
hand-back that worked, after which a late ack deleted the entry of the copy delivered again: a task lost for good."""

import os

from kombu.transport import redis

# NOTE: per process: the delivery tags whose hand-back failed on a lost connection. Only this process held them (a
# message is delivered to one consumer), so no other worker hands them back before the visibility timeout.
_tags_to_restore: set[str] = set()
os.register_at_fork(after_in_child=_tags_to_restore.clear)


class QoS(redis.QoS):
    def restore_unacked(self, client=None):
        tags = set(self._delivered)
        try:
            return super().restore_unacked(client)
        except self.channel.connection_errors:
            _tags_to_restore.update(tags)
            self._delivered.clear()
            raise


class Channel(redis.Channel):
    QoS = QoS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._broker_connection = self.connection.client
        try:
            # NOTE: a tag's entry, while it is there, is the copy this process held: one handed back since (by the
            # visibility timeout) went under a new tag, and this finds nothing to do.
            for tag in list(_tags_to_restore):
                self.qos.restore_by_tag(tag)
                _tags_to_restore.discard(tag)
        except BaseException:
            self.close()  # NOTE: not left in the connection's poller, its Redis pool open; the tags stay remembered
            raise

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        """kombu's, the copy handed back given a delivery tag of its own (see the module's docstring)."""
        try:
            payload["properties"]["delivery_tag"] = self._next_delivery_tag()
        except (KeyError, TypeError):
            pass  # not a message kombu wrote: kombu's own logs it
        return super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)

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
