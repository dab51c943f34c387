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
  its next channel, once Redis answers again (their bodies are in Redis, kept across its restart)."""

from kombu.transport import redis

# NOTE: per process: the delivery tags whose hand-back failed on a lost connection. Only this process held them
# (a message is delivered to one consumer), so no other worker hands them back before the visibility timeout.
_tags_to_restore: set[str] = set()


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
        for tag in list(_tags_to_restore):
            self.qos.restore_by_tag(tag)
            _tags_to_restore.discard(tag)

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
