"""A fake Stripe API: only the calls Inferplane makes, over real HTTP, for the official `stripe` library.

    fake = FakeStripe().start()          # settings.STRIPE_API_BASE = fake.base_url
    fake.fail_next("500", times=2)       # or another of FAILURE_KINDS; optionally path="/v1/customers", method="POST"
    fake.meter_totals()                  # {(customer id, event name): total value}
    fake.prices, fake.subscriptions      # what was created, by id
    fake.cancel_subscription(id), fake.delete_customer(id)   # what the Dashboard does
    fake.cancel_at_period_end(id), fake.end_period(id, at=...)   # a cancellation scheduled, a period's end and invoice
    fake.finalize_invoice(id)                                 # an invoice finalised (a draft for its first hour)
    fake.void_invoice(id)                                     # a finalised invoice voided in the Dashboard
    fake.frozen_s = second                                    # Stripe's clock held at one second (None: runs)
    fake.invoices[id]["auto_advance"] = False                 # a draft Stripe leaves for us to finalise
    fake.invoiced_usage(customer id)                          # what the subscriptions' invoices billed, in meter units
    fake.add_subscription_item(id, meter=event name)          # a second price on a subscription, as staff add one
    fake.remove_subscription_item(id, item id)                # an item deleted (a price swapped), its lines kept
    fake.add_invoice_item(customer id, amount=500)            # a one-off charge, pulled into its next invoice
    fake.line_prices_shown = False                            # subscription items' lines state no price (`pricing` null)
    fake.cancel_in_portal(session id, subscription id)        # the customer's click, as the session's configuration says
    fake.charge(customer id), fake.dispute(charge id), fake.close_dispute(id, "won")   # a payment, and its chargeback
    fake.add_card(fingerprint="fp_x")                         # a card PaymentMethod (the same number: one fingerprint)
    fake.revoke_key(key), fake.restore_key(key)              # a secret key rolled or revoked: 401 to every call

It records every call, replays the stored response for a repeated `Idempotency-Key` (as Stripe
does for 24 h; a key sent again with other parameters is refused), takes a meter event's negative
value as Stripe does (a period whose events sum below 0 is billed as 0), refuses a meter event whose
`identifier` it accepted in the last 24 h (`age_meter_events` moves them back in time; an older one's
identifier is taken again, as a second event), and bills as Stripe documents a subscription to a metered price
does: each invoice of a subscription bills the sum of its price's meter events for the customer dated from where
the last one stopped (from the subscription's `start_date` for the first, which may be backdated) to the end of the
period it closes (`end_period`), received until it is finalised (a draft takes usage of its period during Stripe's
finalization grace) and, for a deleted customer, before its deletion (Stripe drops the events it receives after: it
orders them by their receipt, within a second too, though its clock says only the second). Invoices carry
`status_transitions` (`finalized_at`, `voided_at`, ...) as Stripe's do, and their lines as Stripe's current API shapes
them (`pricing.price_details.price`, a price's id; `parent`), in Stripe's order (pending invoice items first, then
one line per subscription item, the newest first): an invoice shows its first 10 (`lines.has_more`), and `GET /v1/invoices/{id}/lines`
pages through all of them (`starting_after`). A subscription cancelled at once bills what it has not invoiced yet only with
`invoice_now` (Stripe's default is not to: that usage is discarded); one cancelled at its period's end bills it in a
final invoice then. A Customer Portal session uses the configuration it names, or else the account's default one
(`default_portal_features`: cancellation at once, the case this models), and `cancel_in_portal` does what that
configuration lets the customer do. It can be told to fail:

- "500": a server error before Stripe's idempotency layer: nothing done, nothing saved;
- "500_saved": the endpoint began and failed: nothing done, but the 500 is saved under the key and
  every retry with that key gets it again (Stripe saves the first answer, 500s included);
- "500_after_work": the work is done (an object created, an event recorded), then the 500 is saved
  under the key as above: the client cannot tell it from "500_saved";
- "429": refused by the rate limiter, before the idempotency layer: nothing saved;
- "400", "401", "403": refused outright (an invalid request, the key refused, a permission the key lacks), before
  the idempotency layer: nothing done, nothing saved;
- "409_in_flight": another request with the same idempotency key is in flight (a second worker): a 409
  `idempotency_error`, nothing done, nothing saved;
- "timeout": the request is handled, then its answer held until the client gives up and hangs up,
  so the client sees a timeout although Stripe did the work: the case idempotency keys exist for.
  (It waits for the hang-up, not for a fixed time: the client's timeout can be generous, so that an
  ordinary call on a slow machine never times out.)
"""

from __future__ import annotations

import calendar
import copy
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlparse

FAILURE_KINDS = ("500", "500_saved", "500_after_work", "429", "400", "401", "403", "409_in_flight", "timeout")
# What Stripe answers each refusal with: status, error type, code.
_REFUSALS = {
    "400": (400, "invalid_request_error", "parameter_invalid_empty"),
    "401": (401, "invalid_request_error", None),
    "403": (403, "invalid_request_error", "secret_key_required"),
}
IDENTIFIER_WINDOW_S = 24 * 3600  # Stripe refuses a meter event's identifier again "for at least 24 hours"
# A meter event's timestamp Stripe takes: "within the past 35 calendar days or up to 5 minutes in the future".
METER_EVENT_PAST_S = 35 * 86400
METER_EVENT_FUTURE_S = 5 * 60


@dataclass(slots=True)
class Call:
    method: str
    path: str
    params: dict
    idempotency_key: str | None
    status: int = 0
    replayed: bool = False
    injected: str | None = None


@dataclass(slots=True)
class _Failure:
    kind: str
    path: str | None
    method: str | None


@dataclass
class FakeStripe:
    latency_s: float = 0.0  # added to every call, so work takes long enough to be interrupted
    timeout_hang_s: float = 120.0  # the longest a "timeout" failure waits for its client to hang up
    calls: list[Call] = field(default_factory=list)
    customers: dict[str, dict] = field(default_factory=dict)
    meters: dict[str, dict] = field(default_factory=dict)
    meter_events: dict[str, dict] = field(default_factory=dict)  # identifier -> event
    prices: dict[str, dict] = field(default_factory=dict)
    subscriptions: dict[str, dict] = field(default_factory=dict)
    deleted_customers: set[str] = field(default_factory=set)
    charges: dict[str, dict] = field(default_factory=dict)
    payment_methods: dict[str, dict] = field(default_factory=dict)  # by id, as `add_card` made them
    disputes: dict[str, dict] = field(default_factory=dict)
    revoked_keys: set[str] = field(default_factory=set)
    invoices: dict[str, dict] = field(default_factory=dict)  # with all their lines (an answer shows the first 10)
    pending_invoice_items: dict[str, dict] = field(default_factory=dict)  # not invoiced yet, by id
    removed_subscription_items: dict[str, dict] = field(default_factory=dict)  # deleted from their subscription, by id
    portal_configurations: dict[str, dict] = field(default_factory=dict)
    portal_sessions: dict[str, dict] = field(default_factory=dict)
    # What the account's default portal configuration (set in the Dashboard) lets a customer do.
    default_portal_features: dict = field(default_factory=lambda: {
        "invoice_history": {"enabled": True}, "payment_method_update": {"enabled": True},
        "subscription_cancel": {"enabled": True, "mode": "immediately", "proration_behavior": "none"},
        "subscription_pause": {"enabled": False}, "subscription_update": {"enabled": False}})
    num_duplicate_identifiers: int = 0
    unexpected: list[str] = field(default_factory=list)
    # Stripe's clock held at this second (`created` of what it makes, the times of its transitions): to order events
    # within one second, which Stripe's clock cannot tell apart. None: the clock runs.
    frozen_s: int | None = None
    # Whether an invoice line of a subscription item states its price (`pricing.price_details.price`). False: its
    # `pricing` is null, as Stripe's API allows (the line's `parent` names its subscription item, whose price the
    # subscription says), and as it shows pricing of other kinds (rate cards) under another `pricing.type`.
    line_prices_shown: bool = True

    def __post_init__(self):
        self._lock = threading.Lock()
        self._idempotent: dict[str, tuple[dict, int, dict]] = {}  # key -> (params, status, payload)
        self._failures: deque[_Failure] = deque()
        self._server: ThreadingHTTPServer | None = None
        self._num_happenings = 0  # what Stripe did, in the order it did it: meter events received, customers deleted
        self._received_as: dict[int, int] = {}  # id() of a meter event -> its place in that order
        self._deleted_as: dict[str, int] = {}  # customer id -> its deletion's place in that order

    def _now(self) -> int:
        return int(time.time()) if self.frozen_s is None else self.frozen_s

    def _happened(self) -> int:
        self._num_happenings += 1
        return self._num_happenings

    # --- control ---------------------------------------------------------------------------------
    def start(self) -> FakeStripe:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake._handle(self, "GET")

            def do_POST(self):
                fake._handle(self, "POST")

            def do_DELETE(self):
                fake._handle(self, "DELETE")

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-stripe", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, kind: str, *, times: int = 1, path: str | None = None, method: str | None = None) -> None:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"kind must be one of {FAILURE_KINDS}")
        with self._lock:
            self._failures.extend(_Failure(kind, path, method) for _ in range(times))

    def cancel_subscription(self, subscription_id: str, *, at: int | None = None, invoice_now: bool = False) -> dict:
        """What cancelling it at once does (`at`: when, now by default): the subscription as it is now (its webhook's
        object). Its usage not invoiced yet is invoiced now only with `invoice_now` (Stripe's default is false)."""
        with self._lock:
            subscription = self.subscriptions[subscription_id]
            at = self._now() if at is None else at
            if invoice_now:
                self._invoice(subscription, at)
            subscription.update(status="canceled", canceled_at=at, ended_at=at)
            return dict(subscription)

    def cancel_at_period_end(self, subscription_id: str) -> dict:
        """What a cancellation at the period's end does (the Dashboard's, or a portal's set so): still active, it
        ends when its period does (`end_period`). The subscription as it is now."""
        with self._lock:
            subscription = self.subscriptions[subscription_id]
            subscription.update(cancel_at_period_end=True, canceled_at=self._now())
            return dict(subscription)

    def end_period(self, subscription_id: str, *, at: int | None = None) -> dict:
        """What Stripe does when the subscription's period ends (`at`: when, its `current_period_end` by default):
        an invoice of the usage since the last one, then a new period, or, if it was to cancel at the period's end,
        its end. The subscription as it is now (its webhook's object)."""
        with self._lock:
            subscription = self.subscriptions[subscription_id]
            items = subscription["items"]["data"]
            at = items[0]["current_period_end"] if at is None else at
            self._invoice(subscription, at)
            for item in items:
                if subscription["cancel_at_period_end"]:
                    item["current_period_end"] = at
                else:
                    item.update(current_period_start=at, current_period_end=_month_after(at))
            if subscription["cancel_at_period_end"]:
                subscription.update(status="canceled", ended_at=at)
            return dict(subscription)

    def add_subscription_item(self, subscription_id: str, *, meter: str, unit_amount_decimal: str = "0") -> dict:
        """What staff adding a metered price on the meter of event name `meter` to the subscription in the Dashboard
        does (a $0 one, to show a meter's count on the invoice): its next invoice has a line for it. The new item."""
        with self._lock:
            subscription = self.subscriptions[subscription_id]
            [meter_id] = [found["id"] for found in self.meters.values() if found["event_name"] == meter]
            price = {"id": _id("price"), "object": "price", "created": self._now(), "active": True, "currency": "usd",
                     "unit_amount_decimal": unit_amount_decimal,
                     "recurring": {"interval": "month", "usage_type": "metered", "meter": meter_id},
                     "lookup_key": None, "product": _id("prod"), "livemode": False}
            self.prices[price["id"]] = price
            first = subscription["items"]["data"][0]
            item = {"id": _id("si"), "object": "subscription_item", "price": price,
                    "current_period_start": first["current_period_start"],
                    "current_period_end": first["current_period_end"]}
            subscription["items"]["data"].append(item)
            return dict(item)

    def remove_subscription_item(self, subscription_id: str, item_id: str) -> None:
        """What deleting a subscription item does (staff swapping a price in the Dashboard): gone from the subscription
        and its item list, and `GET /v1/subscription_items/{id}` answers 404; lines of invoices made before keep its id."""
        with self._lock:
            items = self.subscriptions[subscription_id]["items"]["data"]
            [item] = [item for item in items if item["id"] == item_id]
            items.remove(item)
            self.removed_subscription_items[item_id] = item

    def add_invoice_item(self, customer_id: str, *, amount: int = 500) -> dict:
        """What a one-off charge made in the Dashboard does (an invoice item of `amount` cents, on a price of its
        own): pending, it is pulled into the customer's next subscription invoice, ahead of its subscription's
        lines. The invoice item."""
        with self._lock:
            price = {"id": _id("price"), "object": "price", "created": self._now(), "active": False, "currency": "usd",
                     "unit_amount_decimal": str(amount), "recurring": None, "lookup_key": None, "product": _id("prod"),
                     "livemode": False}
            self.prices[price["id"]] = price
            item = {"id": _id("ii"), "object": "invoiceitem", "customer": customer_id, "amount": amount,
                    "quantity": 1, "date": self._now(), "price": price["id"], "invoice": None, "livemode": False}
            self.pending_invoice_items[item["id"]] = item
            return dict(item)

    def finalize_invoice(self, invoice_id: str) -> dict:
        """What Stripe does an hour after it made a subscription's invoice (a draft until then): the invoice, open,
        as it is now (its `invoice.finalized` webhook's object)."""
        with self._lock:
            invoice = self.invoices[invoice_id]
            self._finalize(invoice)
            return copy.deepcopy(invoice)

    def void_invoice(self, invoice_id: str) -> dict:
        """What an operator's "Void invoice" in the Dashboard does to a finalised invoice: void, owed by nobody (its
        `invoice.voided` webhook's object), `status_transitions.voided_at` now."""
        with self._lock:
            invoice = self.invoices[invoice_id]
            invoice["status"] = "void"
            invoice["status_transitions"]["voided_at"] = self._now()
            return copy.deepcopy(invoice)

    def cancel_in_portal(self, session_id: str, subscription_id: str) -> dict:
        """What the customer's "Cancel" in the Customer Portal session `session_id` does, as its configuration's
        `features.subscription_cancel` says (its `proration_behavior` can never be `always_invoice`, so a portal
        never invoices usage at the cancellation). Raises PortalRefused where it offers no cancellation."""
        with self._lock:
            cancel = self.portal_configurations[self.portal_sessions[session_id]["configuration"]]["features"].get(
                "subscription_cancel", {})
        if not cancel.get("enabled"):
            raise PortalRefused("this portal offers no cancellation")
        if cancel.get("mode") == "at_period_end":
            return self.cancel_at_period_end(subscription_id)
        return self.cancel_subscription(subscription_id)

    def delete_customer(self, customer_id: str) -> dict:
        """What deleting it in the Dashboard does (its subscriptions end with it): the webhook's object."""
        with self._lock:
            customer = self.customers.pop(customer_id)
            self.deleted_customers.add(customer_id)
            self._deleted_as[customer_id] = self._happened()
            now = self._now()
            for subscription in self.subscriptions.values():
                if subscription["customer"] == customer_id and subscription["status"] != "canceled":
                    subscription.update(status="canceled", canceled_at=now, ended_at=now)
            return dict(customer)

    def revoke_key(self, secret_key: str) -> None:
        """What rolling or deleting the key in the Dashboard does: every call with it is answered 401, none done."""
        with self._lock:
            self.revoked_keys.add(secret_key)

    def restore_key(self, secret_key: str) -> None:
        with self._lock:
            self.revoked_keys.discard(secret_key)

    def forget_idempotency_keys(self) -> None:
        """What Stripe does with an idempotency key a day after its first use: a request under it is new again."""
        with self._lock:
            self._idempotent.clear()

    def age_meter_events(self, seconds: int) -> None:
        """Make every meter event received so far `seconds` older (for Stripe's duplicate window)."""
        with self._lock:
            for event in self.meter_events.values():
                event["created"] -= seconds

    def add_card(self, *, fingerprint: str, last4: str = "4242") -> str:
        """A card PaymentMethod as Stripe shapes one (its `card.fingerprint` is the card number's: the same in every
        customer); its id, for `set_default_payment_method`."""
        with self._lock:
            method = {"id": _id("pm"), "object": "payment_method", "type": "card", "created": self._now(),
                      "customer": None, "livemode": False,
                      "card": {"brand": "visa", "last4": last4, "exp_month": 12, "exp_year": 2030,
                               "fingerprint": fingerprint, "funding": "credit", "country": "US"}}
            self.payment_methods[method["id"]] = method
            return method["id"]

    def _expanded_payment_method(self, customer_id: str, payment_method: str) -> dict:
        """The PaymentMethod `payment_method` expanded; one not made by `add_card` (a test's bare id) is a card of the
        customer's own, one fingerprint per customer."""
        return self.payment_methods.get(payment_method) or {
            "id": payment_method, "object": "payment_method", "type": "card", "customer": customer_id,
            "card": {"brand": "visa", "last4": "4242", "fingerprint": f"fp_own_{customer_id}"}}

    def set_default_payment_method(self, customer_id: str, payment_method: str | None) -> dict:
        """What the Customer Portal does when a card is added (or removed): the customer as it is now."""
        with self._lock:
            customer = self.customers[customer_id]
            customer["invoice_settings"] = {"default_payment_method": payment_method}
            return dict(customer)

    def charge(self, customer_id: str | None, *, amount: int = 4200, invoice: str | None = None) -> dict:
        """A card payment (an invoice's, as Stripe makes it) by `customer_id`; `invoice` only as API versions before
        2025-03-31 show it."""
        with self._lock:
            charge = {"id": _id("ch"), "object": "charge", "created": int(time.time()), "customer": customer_id,
                      "amount": amount, "currency": "usd", "payment_intent": _id("pi"), "disputed": False,
                      "status": "succeeded", "livemode": False, "amount_refunded": 0, "refunded": False}
            if invoice is not None:
                charge["invoice"] = invoice
            self.charges[charge["id"]] = charge
            return dict(charge)

    def refund(self, charge_id: str, *, amount: int | None = None) -> dict:
        """Refund `amount` (all that is left by default) of the charge: its `amount_refunded` is the running total,
        `refunded` once it is all back (what `charge.refunded` carries)."""
        with self._lock:
            charge = self.charges[charge_id]
            charge["amount_refunded"] += charge["amount"] - charge["amount_refunded"] if amount is None else amount
            charge["refunded"] = charge["amount_refunded"] >= charge["amount"]
            return dict(charge)

    def dispute(self, charge_id: str, *, status: str = "needs_response", reason: str = "fraudulent") -> dict:
        """What the cardholder's bank does: the charge is disputed. The dispute as its webhooks carry it (its
        charge by id, no customer or invoice)."""
        with self._lock:
            charge = self.charges[charge_id]
            charge["disputed"] = True
            dispute = {"id": _id("dp"), "object": "dispute", "created": int(time.time()), "charge": charge_id,
                       "payment_intent": charge["payment_intent"], "amount": charge["amount"],
                       "currency": charge["currency"], "status": status, "reason": reason, "livemode": False}
            self.disputes[dispute["id"]] = dispute
            return dict(dispute)

    def close_dispute(self, dispute_id: str, status: str) -> dict:
        """The bank's decision (`won` or `lost`): the dispute as its `charge.dispute.closed` webhook carries it."""
        with self._lock:
            dispute = self.disputes[dispute_id]
            dispute["status"] = status
            return dict(dispute)

    # --- inspection ------------------------------------------------------------------------------
    def meter_totals(self) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = {}
        with self._lock:
            for event in self.meter_events.values():
                key = (event["payload"]["stripe_customer_id"], event["event_name"])
                totals[key] = totals.get(key, 0) + int(event["payload"]["value"])
        return totals

    def invoiced_usage(self, customer_id: str, *, meter: str = "inferplane_usage_cost") -> int:
        """What the invoices of the customer's subscriptions billed of the meter of event name `meter`, in its units."""
        with self._lock:
            return sum(line["quantity"] for invoice in self.invoices.values() if invoice["customer"] == customer_id
                       for line in invoice["lines"]["data"] if self.meter_of(line) == meter)

    def meter_of(self, line: dict) -> str | None:
        """The event name of the meter an invoice line's price is on; None for a line of no meter's price."""
        price = self.prices[self._price_id_of(line)]
        return self.meters[price["recurring"]["meter"]]["event_name"] if (price["recurring"] or {}).get("meter") else None

    def _price_id_of(self, line: dict) -> str:
        """The price of an invoice line: the one it states, or else its subscription item's."""
        if line["pricing"] is not None:
            return line["pricing"]["price_details"]["price"]
        item_id = line["parent"]["subscription_item_details"]["subscription_item"]
        if item_id in self.removed_subscription_items:
            return self.removed_subscription_items[item_id]["price"]["id"]
        return next(item["price"]["id"] for subscription in self.subscriptions.values()
                    for item in subscription["items"]["data"] if item["id"] == item_id)

    def calls_to(self, path: str, method: str = "POST") -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.path == path and call.method == method]

    # --- the API -----------------------------------------------------------------------------------
    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(request.path)
        path = url.path
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0)).decode()
        query = url.query if method in ("GET", "DELETE") and not body else body  # the library sends GET parameters in the URL
        call = Call(method, path, _nested(parse_qsl(query, keep_blank_values=True)), request.headers.get("Idempotency-Key"))
        if self.latency_s:
            time.sleep(self.latency_s)
        authorization = request.headers.get("Authorization") or ""
        with self._lock:
            self.calls.append(call)
            failure = self._take_failure(method, path)
            revoked = authorization.removeprefix("Bearer ") in self.revoked_keys
        if not authorization.startswith("Bearer sk_"):
            return self._answer(request, call, 401, _error("invalid_request_error", "Invalid API Key provided"))
        if revoked:
            return self._answer(request, call, 401, _error("invalid_request_error", "Expired API Key provided"))
        if failure is not None and failure.kind in _REFUSALS:  # before the idempotency layer
            call.injected = failure.kind
            status, kind, code = _REFUSALS[failure.kind]
            return self._answer(request, call, status, _error(kind, f"injected {failure.kind}", code=code))
        if failure is not None and failure.kind in ("500", "429"):  # before the idempotency layer
            call.injected = failure.kind
            status = 500 if failure.kind == "500" else 429
            kind = "api_error" if status == 500 else "invalid_request_error"
            return self._answer(request, call, status, _error(kind, f"injected {failure.kind}", code="rate_limit" if status == 429 else None))
        idempotent = method == "POST" and bool(call.idempotency_key)
        if failure is not None and failure.kind == "409_in_flight" and idempotent:
            call.injected = failure.kind
            return self._answer(request, call, 409, _error(
                "idempotency_error", "There is currently another in-progress request using this Stripe-Idempotency-Key. "
                "Please try again later."))
        with self._lock:
            stored = self._idempotent.get(call.idempotency_key) if idempotent else None
            if stored is not None:
                original_params, status, payload = stored
                if original_params == call.params:
                    call.replayed = True
                else:  # not saved: the original stays what the key replays
                    status, payload = 400, _error("idempotency_error", "Keys for idempotent requests can only be used "
                                                  "with the same parameters they were first used with.")
            else:
                if failure is not None and failure.kind == "500_saved":
                    status, payload = 500, _error("api_error", "injected 500_saved")
                else:
                    status, payload = self._route(method, path, call.params)
                    if failure is not None and failure.kind == "500_after_work":
                        status, payload = 500, _error("api_error", "injected 500_after_work")
                if idempotent:
                    self._idempotent[call.idempotency_key] = (call.params, status, payload)
        if failure is not None:
            call.injected = failure.kind
            if failure.kind == "timeout":  # the work is done, the answer comes too late
                _wait_for_hang_up(request, self.timeout_hang_s)
        self._answer(request, call, status, payload, replayed=call.replayed)

    def _take_failure(self, method: str, path: str) -> _Failure | None:
        for index, failure in enumerate(self._failures):
            if failure.path in (None, path) and failure.method in (None, method):
                del self._failures[index]
                return failure
        return None

    def _route(self, method: str, path: str, params: dict) -> tuple[int, dict]:
        now = self._now()
        if (method, path) == ("POST", "/v1/customers"):
            customer = {"id": _id("cus"), "object": "customer", "created": now, "name": params.get("name"),
                        "metadata": params.get("metadata", {}), "livemode": False, "default_source": None,
                        "invoice_settings": {"default_payment_method": None}}
            self.customers[customer["id"]] = customer
            return 200, customer
        if method == "GET" and path.startswith("/v1/customers/"):
            customer_id = path.removeprefix("/v1/customers/")
            if customer_id in self.deleted_customers:  # Stripe answers a deleted customer, not a 404
                return 200, {"id": customer_id, "object": "customer", "deleted": True}
            customer = self.customers.get(customer_id)
            if customer is None:
                return 404, _error("invalid_request_error", "No such customer", code="resource_missing")
            if "invoice_settings.default_payment_method" in (params.get("expand") or {}).values():
                method = (customer.get("invoice_settings") or {}).get("default_payment_method")
                if method:
                    customer = {**customer, "invoice_settings": {
                        **customer["invoice_settings"], "default_payment_method": self._expanded_payment_method(
                            customer_id, method)}}
            return 200, customer
        if (method, path) == ("GET", "/v1/charges"):  # newest first, as Stripe lists them
            found = [charge for charge in reversed(self.charges.values())
                     if params.get("customer") in (None, charge["customer"])]
            return 200, _page(found, params, url=path)
        if method == "GET" and path.startswith("/v1/charges/"):
            charge = self.charges.get(path.removeprefix("/v1/charges/"))
            if charge is None:
                return 404, _error("invalid_request_error", "No such charge", code="resource_missing")
            return 200, charge
        if (method, path) == ("POST", "/v1/billing/meters"):
            meter = {"id": _id("mtr"), "object": "billing.meter", "created": now, "status": "active",
                     "event_name": params["event_name"], "display_name": params.get("display_name"),
                     "default_aggregation": params.get("default_aggregation"), "livemode": False}
            self.meters[meter["id"]] = meter
            return 200, meter
        if (method, path) == ("GET", "/v1/billing/meters"):
            return 200, {"object": "list", "data": list(self.meters.values()), "has_more": False, "url": path}
        if (method, path) == ("POST", "/v1/billing/meter_events"):
            return self._meter_event(params, now)
        if (method, path) == ("GET", "/v1/prices"):
            lookup_keys = set((params.get("lookup_keys") or {}).values())
            found = [price for price in self.prices.values() if price["lookup_key"] in lookup_keys]
            return 200, {"object": "list", "data": found, "has_more": False, "url": path}
        if (method, path) == ("POST", "/v1/prices"):
            return self._price(params, now)
        if (method, path) == ("POST", "/v1/subscriptions"):
            return self._subscription(params, now)
        if (method, path) == ("GET", "/v1/subscriptions"):
            return 200, {"object": "list", "data": [_shown_subscription(found) for found in self._list_subscriptions(params)],
                         "has_more": False, "url": path}
        if method == "DELETE" and path.startswith("/v1/subscriptions/"):
            # Cancelled at once; with `invoice_now`, its usage not invoiced yet billed by a final invoice now. Stripe
            # takes no idempotency key on a DELETE: one of an ended subscription is refused.
            subscription = self.subscriptions.get(path.removeprefix("/v1/subscriptions/"))
            if subscription is None:
                return 404, _error("invalid_request_error", "No such subscription", code="resource_missing")
            if subscription["status"] in ("canceled", "incomplete_expired"):
                return 400, _error("invalid_request_error", "This subscription is already canceled.")
            if params.get("invoice_now") == "true":
                self._invoice(subscription, now)
            subscription.update(status="canceled", canceled_at=now, ended_at=now)
            return 200, _shown_subscription(subscription)
        if method == "GET" and path.startswith("/v1/subscriptions/"):
            subscription = self.subscriptions.get(path.removeprefix("/v1/subscriptions/"))
            if subscription is None:
                return 404, _error("invalid_request_error", "No such subscription", code="resource_missing")
            return 200, _shown_subscription(subscription)
        if (method, path) == ("GET", "/v1/subscription_items"):
            subscription = self.subscriptions.get(params.get("subscription") or "")
            if subscription is None:
                return 404, _error("invalid_request_error", "No such subscription", code="resource_missing")
            items = subscription["items"]["data"]
            after = params.get("starting_after")
            start = next((index + 1 for index, item in enumerate(items) if item["id"] == after), 0) if after else 0
            limit = int(params.get("limit") or 10)
            return 200, {"object": "list", "data": items[start:start + limit], "has_more": start + limit < len(items),
                         "url": path}
        if method == "GET" and path.startswith("/v1/subscription_items/"):
            item_id = path.removeprefix("/v1/subscription_items/")
            found = [item for subscription in self.subscriptions.values() for item in subscription["items"]["data"]
                     if item["id"] == item_id]
            if not found:  # NOTE: a deleted item too
                return 404, _error("invalid_request_error", "No such subscription item", code="resource_missing")
            return 200, found[0]
        if (method, path) == ("GET", "/v1/invoices"):
            found = [invoice for invoice in reversed(self.invoices.values())  # newest first
                     if params.get("customer") in (None, invoice["customer"])
                     and params.get("subscription") in (None, invoice["parent"]["subscription_details"]["subscription"])]
            return 200, {"object": "list", "data": [_shown(invoice) for invoice in found[:int(params.get("limit") or 10)]],
                         "has_more": False, "url": path}
        if path.startswith("/v1/invoices/"):
            invoice_id, _, action = path.removeprefix("/v1/invoices/").partition("/")
            invoice = self.invoices.get(invoice_id)
            if invoice is None or (method, action) not in (("GET", ""), ("POST", "finalize"), ("GET", "lines")):
                return 404, _error("invalid_request_error", "No such invoice", code="resource_missing")
            if action == "lines":
                return 200, _page(invoice["lines"]["data"], params, url=path)
            if action == "finalize":  # NOTE: a deleted customer's too: Stripe keeps its invoices
                if invoice["status"] != "draft":
                    return 400, _error("invalid_request_error", "This invoice is already finalized",
                                       code="invoice_not_editable")
                self._finalize(invoice)
            return 200, _shown(invoice)
        if path.startswith("/v1/billing_portal/configurations"):
            return self._portal_configuration(method, path.removeprefix("/v1/billing_portal/configurations"),
                                              _typed(params), now)
        if (method, path) == ("POST", "/v1/billing_portal/sessions"):
            if params.get("customer") not in self.customers:
                return 400, _error("invalid_request_error", "No such customer", code="resource_missing")
            configuration_id = params.get("configuration") or self._default_portal_configuration(now)
            if not self.portal_configurations.get(configuration_id, {}).get("active"):
                return 400, _error("invalid_request_error", "No such configuration", code="resource_missing")
            session = {"id": _id("bps"), "object": "billing_portal.session", "customer": params["customer"],
                       "configuration": configuration_id, "return_url": params.get("return_url"),
                       "url": f"https://billing.stripe.test/p/{_id('session')}"}
            self.portal_sessions[session["id"]] = session
            return 200, session
        self.unexpected.append(f"{method} {path}")
        return 404, _error("invalid_request_error", f"Unrecognized request URL ({method}: {path})")

    def _portal_configuration(self, method: str, rest: str, params: dict, now: int) -> tuple[int, dict]:
        if (method, rest) == ("GET", ""):
            found = [configuration for configuration in reversed(self.portal_configurations.values())
                     if params.get("active") is None or configuration["active"] == params["active"]]
            return 200, {"object": "list", "data": found[:int(params.get("limit") or 10)], "has_more": False,
                         "url": "/v1/billing_portal/configurations"}
        if (method, rest) == ("POST", ""):
            configuration = {"id": _id("bpc"), "object": "billing_portal.configuration", "active": True,
                             "is_default": False, "created": now, "livemode": False,
                             "metadata": params.get("metadata", {}), "features": {}}
            self.portal_configurations[configuration["id"]] = configuration
            rest = "/" + configuration["id"]
        configuration = self.portal_configurations.get(rest.removeprefix("/"))
        if configuration is None:
            return 404, _error("invalid_request_error", "No such configuration", code="resource_missing")
        if method == "POST":
            cancel = (params.get("features") or {}).get("subscription_cancel") or {}
            if cancel.get("proration_behavior") == "always_invoice":
                return 400, _error("invalid_request_error", "always_invoice is not supported for cancellations",
                                   code="parameter_invalid")
            for name, feature in (params.get("features") or {}).items():
                configuration["features"].setdefault(name, {}).update(feature)
            if "active" in params:
                configuration["active"] = params["active"] in (True, "true")
            configuration["metadata"].update(params.get("metadata") or {})
        return 200, configuration

    def _default_portal_configuration(self, now: int) -> str:
        """The account's default configuration, made as the Dashboard makes it the first time it is needed."""
        default = next((configuration for configuration in self.portal_configurations.values()
                        if configuration["is_default"]), None)
        if default is None:
            default = {"id": _id("bpc"), "object": "billing_portal.configuration", "active": True, "is_default": True,
                       "created": now, "livemode": False, "metadata": {},
                       "features": json.loads(json.dumps(self.default_portal_features))}
            self.portal_configurations[default["id"]] = default
        return default["id"]

    def _invoice(self, subscription: dict, end: int) -> dict:
        """The subscription's invoice of its prices' usage from where its last invoice stopped (its start for the
        first) to `end`: for each item, the sum of the customer's meter events of its price's meter dated in that time;
        the customer's pending invoice items ahead of them, as Stripe orders an invoice's lines."""
        invoiced = [invoice["period_end"] for invoice in self.invoices.values()
                    if invoice["parent"]["subscription_details"]["subscription"] == subscription["id"]]
        start = max(invoiced, default=subscription["start_date"])
        invoice_id = _id("in")
        pending = [item for item in self.pending_invoice_items.values() if item["customer"] == subscription["customer"]]
        lines = [{"id": _id("il"), "object": "line_item", "invoice": invoice_id, "quantity": item["quantity"],
                  "amount": item["amount"], "period": {"start": item["date"], "end": item["date"]},
                  "pricing": _pricing(self.prices[item["price"]]),
                  "parent": {"type": "invoice_item_details",
                             "invoice_item_details": {"invoice_item": item["id"], "subscription": None}}}
                 for item in pending]
        for item in pending:
            item["invoice"] = invoice_id
            del self.pending_invoice_items[item["id"]]
        lines += [{"id": _id("il"), "object": "line_item", "invoice": invoice_id, "quantity": 0, "amount": 0,
                   "period": {"start": start, "end": end},
                   "pricing": _pricing(item["price"]) if self.line_prices_shown else None,
                   "parent": {"type": "subscription_item_details",
                              "subscription_item_details": {"subscription": subscription["id"],
                                                            "subscription_item": item["id"]}}}
                  for item in reversed(subscription["items"]["data"])]  # the newest item's first, as Stripe
        invoice = {"id": invoice_id, "object": "invoice", "created": self._now(), "status": "draft", "auto_advance": True,
                   "customer": subscription["customer"], "period_start": start, "period_end": end,
                   "parent": {"type": "subscription_details", "subscription_details": {"subscription": subscription["id"]}},
                   "amount_due": 0, "lines": {"object": "list", "data": lines, "has_more": False,
                                              "url": f"/v1/invoices/{invoice_id}/lines"},
                   "status_transitions": {"finalized_at": None, "marked_uncollectible_at": None, "paid_at": None,
                                          "voided_at": None},
                   "livemode": False}
        self._count_usage(invoice)
        self.invoices[invoice["id"]] = invoice
        return invoice

    def _count_usage(self, invoice: dict) -> None:
        """The draft `invoice`'s lines bill their price's meter events for its customer dated in their period, received
        so far and, for a deleted customer, before its deletion."""
        deleted_as = self._deleted_as.get(invoice["customer"])
        for line in invoice["lines"]["data"]:
            event_name = self.meter_of(line)
            if event_name is None:  # an invoice item: a fixed amount
                continue
            # A period's negative total (negative events outweighing the rest) is billed as 0, as Stripe documents.
            line["quantity"] = max(0, sum(
                int(event["payload"]["value"]) for event in self.meter_events.values()
                if event["event_name"] == event_name and event["payload"]["stripe_customer_id"] == invoice["customer"]
                and line["period"]["start"] <= event["timestamp"] < line["period"]["end"]
                and (deleted_as is None or self._received_as.get(id(event), 0) < deleted_as)))
            line["amount"] = round(line["quantity"] * float(self.prices[self._price_id_of(line)]["unit_amount_decimal"]))
        invoice["amount_due"] = sum(line["amount"] for line in invoice["lines"]["data"])

    def _finalize(self, invoice: dict) -> None:
        """A draft finalised: its usage counted a last time (what Stripe received during its finalization grace),
        open."""
        self._count_usage(invoice)
        invoice["status"] = "open"
        invoice["status_transitions"]["finalized_at"] = self._now()

    def _meter_event(self, params: dict, now: int) -> tuple[int, dict]:
        if params.get("event_name") not in {meter["event_name"] for meter in self.meters.values()}:
            return 400, _error("invalid_request_error", "No active meter found for this event_name", code="resource_missing")
        payload = params.get("payload") or {}
        # NOTE: Stripe processes meter events later: one for a deleted customer is accepted, and billed by nothing.
        if payload.get("stripe_customer_id") not in self.customers.keys() | self.deleted_customers:
            return 400, _error("invalid_request_error", "No such customer", code="resource_missing")
        if not re.fullmatch(r"-?\d+", str(payload.get("value", ""))):  # Stripe takes negative values
            return 400, _error("invalid_request_error", "value must be a whole number", code="parameter_invalid_integer")
        timestamp = int(params.get("timestamp") or now)
        if not now - METER_EVENT_PAST_S <= timestamp <= now + METER_EVENT_FUTURE_S:
            # As Stripe documents: "Must be within the past 35 calendar days or up to 5 minutes in the future."
            return 400, _error("invalid_request_error", "The timestamp must be within the past 35 calendar days or up "
                               "to 5 minutes in the future.")
        identifier = params.get("identifier") or _id("ident")
        earlier = self.meter_events.get(identifier)
        if earlier is not None and now - earlier["created"] < IDENTIFIER_WINDOW_S:
            self.num_duplicate_identifiers += 1
            return 400, _error("invalid_request_error", f"An event with identifier {identifier} already exists.",
                               code="duplicate_meter_event")
        if earlier is not None:  # past the window: Stripe takes it as a new event, and counts it again
            self.meter_events[f"{identifier}@{earlier['created']}"] = self.meter_events.pop(identifier)
        event = {"object": "billing.meter_event", "created": now, "event_name": params["event_name"],
                 "identifier": identifier, "payload": payload, "timestamp": timestamp,
                 "livemode": False}
        self.meter_events[identifier] = event
        self._received_as[id(event)] = self._happened()
        return 200, event

    def _price(self, params: dict, now: int) -> tuple[int, dict]:
        recurring = params.get("recurring") or {}
        if recurring.get("usage_type") == "metered" and recurring.get("meter") not in self.meters:
            return 400, _error("invalid_request_error", "No such billing meter", code="resource_missing")
        lookup_key = params.get("lookup_key")
        if lookup_key and any(price["lookup_key"] == lookup_key for price in self.prices.values()):
            return 400, _error("invalid_request_error", f"A price with lookup key {lookup_key} already exists.",
                               code="lookup_key_exists")
        price = {"id": _id("price"), "object": "price", "created": now, "active": True, "currency": params.get("currency"),
                 "unit_amount_decimal": params.get("unit_amount_decimal"), "recurring": recurring,
                 "lookup_key": lookup_key, "product": _id("prod"), "livemode": False}
        self.prices[price["id"]] = price
        return 200, price

    def _subscription(self, params: dict, now: int) -> tuple[int, dict]:
        if params.get("customer") not in self.customers:
            return 400, _error("invalid_request_error", "No such customer", code="resource_missing")
        items = [item for _, item in sorted((params.get("items") or {}).items(), key=lambda pair: int(pair[0]))]
        if not items or any(item.get("price") not in self.prices for item in items):
            return 400, _error("invalid_request_error", "No such price", code="resource_missing")
        # NOTE: a backdated subscription's first period begins now (its billing cycle anchor); its first invoice
        # bills the usage since its start all the same.
        subscription = {
            "id": _id("sub"), "object": "subscription", "created": now, "status": "active", "customer": params["customer"],
            "start_date": int(params.get("backdate_start_date") or now), "canceled_at": None, "ended_at": None,
            "cancel_at_period_end": False, "billing_cycle_anchor": now, "metadata": params.get("metadata", {}),
            "items": {"object": "list", "data": [{"id": _id("si"), "object": "subscription_item",
                                                  "price": self.prices[item["price"]], "current_period_start": now,
                                                  "current_period_end": _month_after(now)}
                                                 for item in items]},
            "livemode": False,
        }
        self.subscriptions[subscription["id"]] = subscription
        return 200, _shown_subscription(subscription)

    def _list_subscriptions(self, params: dict) -> list[dict]:
        status = params.get("status")
        found = []
        for subscription in reversed(self.subscriptions.values()):  # newest first, as Stripe lists them
            if params.get("customer") not in (None, subscription["customer"]):
                continue
            if params.get("price") and all(item["price"]["id"] != params["price"] for item in subscription["items"]["data"]):
                continue
            if status != "all" and (subscription["status"] == "canceled" if status is None else subscription["status"] != status):
                continue
            found.append(subscription)
        return found[:int(params.get("limit") or 10)]

    def _answer(self, request, call: Call, status: int, payload: dict, *, replayed: bool = False) -> None:
        call.status = status
        data = json.dumps(payload).encode()
        try:
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(data)))
            request.send_header("Request-Id", _id("req"))
            if replayed:
                request.send_header("Idempotent-Replayed", "true")
            request.end_headers()
            request.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout): Stripe's work stands all the same


# How many lines an invoice shows (Stripe's "first handful"): the rest are read from its `lines` list's `url`.
INVOICE_LINES_SHOWN = 10


def _shown_subscription(subscription: dict) -> dict:
    """A subscription as Stripe's answers show it: its first 10 items (`items.has_more`; the rest are listed by
    `GET /v1/subscription_items?subscription=`)."""
    items = subscription["items"]["data"]
    return {**subscription, "items": {"object": "list", "data": items[:10], "has_more": len(items) > 10,
                                      "url": f"/v1/subscription_items?subscription={subscription['id']}"}}


def _shown(invoice: dict) -> dict:
    """`invoice` as Stripe answers it: its first `INVOICE_LINES_SHOWN` lines, `has_more` if it has others."""
    lines = invoice["lines"]["data"]
    return {**invoice, "lines": {**invoice["lines"], "data": lines[:INVOICE_LINES_SHOWN],
                                 "has_more": len(lines) > INVOICE_LINES_SHOWN}}


def _page(found: list[dict], params: dict, *, url: str) -> dict:
    """A page of a list as Stripe answers it: `limit` (10 by default) after `starting_after`'s id."""
    after = params.get("starting_after")
    start = next((index + 1 for index, item in enumerate(found) if item["id"] == after), 0) if after else 0
    limit = int(params.get("limit") or 10)
    return {"object": "list", "data": found[start:start + limit], "has_more": start + limit < len(found), "url": url}


def _pricing(price: dict) -> dict:
    """An invoice line's `pricing` (Stripe's API since 2025-03-31: the price by id, no `price` object)."""
    return {"type": "price_details", "price_details": {"price": price["id"], "product": price["product"]},
            "unit_amount_decimal": price["unit_amount_decimal"]}


def _wait_for_hang_up(request: BaseHTTPRequestHandler, limit_s: float) -> None:
    """Until the client closes the connection (its timeout fired), or `limit_s`. A client waiting
    for its answer sends nothing more, so the first read that returns returns end-of-stream."""
    connection = request.connection
    connection.settimeout(limit_s)
    try:
        while connection.recv(4096):
            pass
    except OSError:  # the limit passed, or the connection broke
        pass


def sign_webhook(payload: bytes, secret: str, *, timestamp: int | None = None) -> str:
    """A `Stripe-Signature` header for `payload`, as Stripe computes it."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    signed = f"{timestamp}.{payload.decode()}".encode()
    return f"t={timestamp},v1={hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()}"


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _error(kind: str, message: str, *, code: str | None = None) -> dict:
    error = {"type": kind, "message": message}
    if code:
        error["code"] = code
    return {"error": error}


class PortalRefused(Exception):
    """The Customer Portal offers no such action (its configuration's feature is off)."""


def _month_after(epoch: int) -> int:
    """The same day and time a calendar month on (the last day of a shorter month), as Stripe's monthly periods."""
    moment = datetime.fromtimestamp(epoch, tz=UTC)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return int(moment.replace(year=year, month=month, day=min(moment.day, calendar.monthrange(year, month)[1])).timestamp())


def _typed(value):
    """Form-encoded values as Stripe reads them: "true"/"false" as booleans, `a[0]=x` as lists."""
    if isinstance(value, dict):
        if value and all(key.isdigit() for key in value):
            return [_typed(value[key]) for key in sorted(value, key=int)]
        return {key: _typed(item) for key, item in value.items()}
    return {"true": True, "false": False}.get(value, value)


def _nested(pairs: list[tuple[str, str]]) -> dict:
    """Stripe's form encoding (`payload[value]=3`, `items[0][price]=x`) back into dicts."""
    result: dict = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        target = result
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return result
