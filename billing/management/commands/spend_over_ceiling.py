"""`spend_over_ceiling`: list the postpaid organisations whose spend this month has reached their spending ceiling
(`billing.standing.spend_ceiling`), so refused calls at the ceiling: what an operator checks after an upgrade
(`billing/0032` gives those that used the platform a floor), or after changing `INFERPLANE_SPEND_CEILINGS`; and the
ceilings staff set that their paid history now passes, which paying does not raise. It changes nothing.

NOTE: one organisation at a time, each read through an index that leads with it (the ledger's
`usage_org_finished`): before, it picked the organisations that spent this month from the whole usage ledger, which
no index of `finished_at` alone serves (a sequential scan of the biggest table on every run)."""

from django.core.management.base import BaseCommand

from billing import standing
from billing.ledger import period_spend
from billing.models import BillingAccount, BillingMode
from billing.periods import current_period


class Command(BaseCommand):
    help = "List the organisations whose spend this month is at or past their spending ceiling (changes nothing)."

    def handle(self, *args, **options):
        period = current_period()
        accounts = (BillingAccount.objects.filter(mode=BillingMode.POSTPAID, invoiced_without_card=False)
                    .select_related("organization").order_by("organization_id"))
        num_over = 0
        for account in accounts.iterator():
            # NOTE: the card's others' spend in the month the organisation's own is read in (`period`): by default
            # `card_spend` read PostgreSQL's clock again, a query per organisation, and at a month's edge the room
            # was the next month's beside this month's spend.
            card = (standing.card_spend([account.card_fingerprint], period)[account.card_fingerprint]
                    if account.card_fingerprint and standing.spend_ceiling_applies(account) else None)
            ceiling = standing.spend_ceiling(account, card=card)
            if ceiling is None or ceiling.room is None:
                continue
            spend = period_spend(account.organization_id, period)
            if spend < ceiling.room:
                continue
            num_over += 1
            shared = (f"\tshared by {ceiling.num_other_organizations_on_card + 1} organisations on its card, the others "
                      f"spent ${ceiling.spent_by_others:,.2f}" if ceiling.num_other_organizations_on_card else "")
            self.stdout.write(f"{account.organization_id}\t{account.organization.slug}\tspent ${spend:,.2f}\t"
                              f"ceiling ${ceiling.amount:,.2f} ({ceiling.source})\tnet paid ${ceiling.paid:,.2f}{shared}")
        self.stdout.write(f"{num_over} organisation(s) at or past their spending ceiling in {period.key}.")
        self._staff_ceilings_below_history()

    def _staff_ceilings_below_history(self) -> None:
        """Staff's ceilings, which paying does not raise, that its paid history now gives more than: clear them in
        the admin (empty) to let the history's apply."""
        num_below = 0
        accounts = (BillingAccount.objects.filter(staff_spend_ceiling__isnull=False, mode=BillingMode.POSTPAID,
                                                  invoiced_without_card=False)
                    .select_related("organization").order_by("organization_id"))
        for account in accounts:
            history = standing.paid_history_ceiling(standing.net_paid(account.organization_id))
            if history.amount is not None and history.amount <= account.staff_spend_ceiling:
                continue
            num_below += 1
            shown = "none" if history.amount is None else f"${history.amount:,.2f}"
            self.stdout.write(f"{account.organization_id}\t{account.organization.slug}\tstaff ceiling "
                              f"${account.staff_spend_ceiling:,.2f} below its paid history's ({shown})")
        self.stdout.write(f"{num_below} staff ceiling(s) below what their paid history gives.")
