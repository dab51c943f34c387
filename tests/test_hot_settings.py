"""Settings read on every request as plain attributes (`controlplane.hot_settings.hot`): the same values as
`django.conf.settings`, changes included, without its lazy wrapper's look-up on each read."""

import asyncio
import threading
from decimal import Decimal

import pytest
from django.conf import LazySettings, settings
from django.test import override_settings

from billing import standing
from billing.quota import counters
from controlplane import hot_settings
from controlplane.hot_settings import hot
from endpoints.gateway import delivery


def test_a_hot_setting_reads_as_djangos():
    assert hot.BILLING_RESERVATION_TTL_S == settings.BILLING_RESERVATION_TTL_S
    assert hot.GATEWAY_ANSWER_BYTES_PER_ORG == settings.GATEWAY_ANSWER_BYTES_PER_ORG


def test_a_hot_setting_follows_the_settings_fixture(settings):
    before = hot.BILLING_RESERVATION_TTL_S
    settings.BILLING_RESERVATION_TTL_S = before + 17
    assert hot.BILLING_RESERVATION_TTL_S == before + 17
    settings.BILLING_RESERVATION_TTL_S = before + 18
    assert hot.BILLING_RESERVATION_TTL_S == before + 18


def test_a_hot_setting_follows_override_settings_and_its_undoing():
    before = hot.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD
    with override_settings(SPEND_LIMIT_WITHOUT_PAYMENT_METHOD=Decimal("12.5"), STRIPE_SECRET_KEY="sk_test_x",
                           SPEND_CEILINGS=((Decimal(0), Decimal(100)), (Decimal(50), None))):
        assert hot.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD == Decimal("12.5")
        assert counters.limits_version() == "4:12.5:1:0:100,50:none"
    assert hot.SPEND_LIMIT_WITHOUT_PAYMENT_METHOD == before


def test_a_setting_changed_while_another_thread_reads_it_is_not_kept_stale(monkeypatch):
    """The reader stored what it read after the change's signal had dropped it: `hot` kept the old value for good."""
    hot.__dict__.pop("BILLING_RESERVATION_TTL_S", None)
    before = settings.BILLING_RESERVATION_TTL_S
    change = override_settings(BILLING_RESERVATION_TTL_S=before + 99)
    read, changed = threading.Event(), threading.Event()

    class ReadJustBeforeTheChange:  # settings as the reader thread sees them: its read lands, then the change
        def __getattr__(self, name):
            value = getattr(settings, name)
            read.set()
            changed.wait(timeout=30)
            return value

    monkeypatch.setattr(hot_settings, "settings", ReadJustBeforeTheChange())
    reader = threading.Thread(target=lambda: hot.BILLING_RESERVATION_TTL_S)
    reader.start()
    assert read.wait(timeout=30)
    change.enable()  # another thread's override_settings: the setting_changed signal
    changed.set()
    reader.join()
    monkeypatch.setattr(hot_settings, "settings", settings)
    try:
        assert hot.BILLING_RESERVATION_TTL_S == before + 99
    finally:
        change.disable()
    assert hot.BILLING_RESERVATION_TTL_S == before


def test_an_unknown_setting_is_refused_as_django_refuses_it():
    with pytest.raises(AttributeError):
        hot.NO_SUCH_SETTING  # noqa: B018


def test_the_warm_paths_settings_are_read_without_djangos_lazy_look_up(monkeypatch):
    """Twelve reads a request went through `LazyObject.__getattribute__` (0.4–0.8 µs each, timed alone)."""
    names = {
        "BILLING_RESERVATION_TTL_S",
        "SPEND_LIMIT_WITHOUT_PAYMENT_METHOD",
        "SPEND_CEILINGS",
        "STRIPE_SECRET_KEY",
        "GATEWAY_ANSWER_BYTES_PER_ORG",
        "GATEWAY_ANSWER_BYTES_PER_PROCESS",
    }
    read = []
    look_up = LazySettings.__getattribute__

    def counted(self, name):
        if name in names:
            read.append(name)
        return look_up(self, name)

    async def a_request_s_worth():
        counters.limits_version()
        standing.bills_through_stripe()
        counters._held_since(1_000_000.0)
        holding = delivery.Holding(organization_id=987_654)
        holding.take(100, connection=None)
        holding.close()

    asyncio.run(a_request_s_worth())  # each read once
    monkeypatch.setattr(LazySettings, "__getattribute__", counted)
    for _ in range(3):
        asyncio.run(a_request_s_worth())
    assert read == []
