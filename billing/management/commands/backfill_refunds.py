"""`backfill_refunds`: record the refunds Stripe made before `charge.refunded` reached us (`billing.refund_backfill`),
so that money refunded then no longer raises a spending ceiling. Run it once the webhook endpoint sends
`charge.refunded` and every web pod runs this version; safe to run again. A customer whose charges cannot be read
is logged and the others still are; the run then ends non-zero, naming them: run it again."""

from django.core.management.base import BaseCommand, CommandError

from billing import refund_backfill, stripe_sync


class Command(BaseCommand):
    help = "Read every known Stripe customer's charges and record what each refunded (idempotent)."

    def handle(self, *args, **options):
        if not stripe_sync.is_configured():
            raise CommandError("Stripe is not configured (STRIPE_SECRET_KEY): nothing is invoiced, nothing to read.")
        done = refund_backfill.backfill_refunds()
        self.stdout.write(f"{done.num_customers} customer(s) read, {done.num_charges_recorded} refunded charge(s) "
                          f"recorded; organisations whose ceiling may fall: {list(done.organization_ids)}.")
        if done.failed_customer_ids:
            raise CommandError(f"{len(done.failed_customer_ids)} customer(s) could not be read (logged), run it "
                               f"again: {', '.join(done.failed_customer_ids)}")
