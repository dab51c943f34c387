"""Formatting and navigation helpers for console templates."""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation

from django import template
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

from controlplane.text import shown_name

register = template.Library()


@register.simple_tag(takes_context=True)
def navlink(context, url_name: str, label: str, section: str):
    """A main-navigation link, marked current when the page's URL name starts with `section`."""
    match = getattr(context.get("request"), "resolver_match", None)
    current = bool(match and match.namespace == "console" and (match.url_name or "").startswith(section))
    if current:
        return format_html('<a href="{}" class="active" aria-current="page">{}</a>', reverse(url_name), label)
    return format_html('<a href="{}">{}</a>', reverse(url_name), label)


def _amount(value) -> Decimal | str:
    """`value` as an amount of money, or what to show instead: a dash for none, the text itself for what is not one."""
    if value in (None, ""):
        return "—"
    try:
        return Decimal(str(value))
    except InvalidOperation:
        return str(value)


@register.filter
def usd(value) -> str:
    """Money for people: $1,234.56; amounts under a cent keep enough digits to be non-zero."""
    amount = _amount(value)
    if not isinstance(amount, Decimal):
        return amount
    if amount != 0 and abs(amount) < Decimal("0.01"):
        return f"${amount:.6f}".rstrip("0")
    return f"${amount:,.2f}"


@register.filter
def price(value) -> str:
    """A price as it is charged, every digit kept: $0.025, $0.10, $1,234.50. NOTE: not `usd`, which rounds to the cent
    for amounts spent: a cached-input price of $0.025 / M read "$0.02 / M", less than the ledger charges."""
    amount = _amount(value)
    if not isinstance(amount, Decimal):
        return amount
    whole, _, fraction = f"{amount:,f}".partition(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


@register.filter
def compact(value) -> str:
    """Large counts in a few characters: 950, 12.3k, 4.5M."""
    if value in (None, ""):
        return "0"
    number = float(value)
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(number) >= limit:
            return f"{number / limit:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{int(number):,}"


@register.filter
def percent_of(value, total) -> float:
    """`value` as a percentage of `total`, clamped to 0–100 (for bar widths)."""
    try:
        share = 100.0 * float(value) / float(total)
    except (TypeError, ValueError, ZeroDivisionError):
        return 0.0
    if math.isnan(share):  # NOTE: `max(nan, 0.0)` is NaN: it passed the clamp, and a bar was `<rect width="nan">`
        return 0.0
    return round(min(max(share, 0.0), 100.0), 1)


@register.simple_tag
def bar_fill(percent) -> str:
    """A `.bar`'s filled share, `percent` of its width (clamped to 0–100), drawn as SVG geometry.

    NOTE: not a `style="width: …"`: the Content-Security-Policy refuses inline styles (`style-src 'self'`), and an SVG
    attribute is geometry, which no policy governs."""
    return format_html('<svg class="bar-fill" viewBox="0 0 100 1" preserveAspectRatio="none" aria-hidden="true" '
                       'focusable="false"><rect width="{}" height="1"></rect></svg>', percent_of(percent, 100))


@register.filter
def get_item(mapping, key):
    return mapping.get(key) if hasattr(mapping, "get") else None


@register.filter
def cents(value) -> str:
    """An amount in a currency's minor unit (as Stripe sends it) as 1,234.56."""
    if value in (None, ""):
        return "—"
    return f"{Decimal(int(value)) / 100:,.2f}"


@register.filter
def ago(moment) -> str:
    """How long ago, in a few words: "just now", "5 minutes ago"."""
    if moment is None:
        return "never"
    if (timezone.now() - moment).total_seconds() < 60:
        return "just now"
    return f"{timesince(moment).split(',')[0]} ago"


@register.filter(name="shown_name")
def shown_name_filter(value) -> str:
    """A name a tenant set (a key's, an organisation's, an address), its control and format characters escaped
    (`text.shown_name`): one stored before they were refused is shown as it is, never reordered by a direction
    override."""
    return shown_name(str(value)) if value is not None else ""
