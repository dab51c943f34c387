"""`backfill_card_fingerprints`: read from Stripe the card of every postpaid organisation with a payment method on file
(`stripe_sync.observe_card_fingerprints`): those read before fingerprints were kept (`billing/0034`), or by a pod of
the previous version during the deploy, would share their card's month only at their next reading (a card changed,
the billing page opened). Run it once every pod runs this version; safe to run again. A customer that cannot be read is logged and
the others still are; the run then ends non-zero, naming them: run it again."""

from django.core.management.base import BaseCommand, CommandError

from billing import stripe_sync


class Command(BaseCommand):
    help = "Read the card fingerprint of every postpaid customer with a payment method on file (idempotent)."

    def handle(self, *args, **options):
        if not stripe_sync.is_configured():
            raise CommandError("Stripe is not configured (STRIPE_SECRET_KEY): nothing is invoiced, nothing to read.")
        num_read, failed = stripe_sync.observe_card_fingerprints()
        self.stdout.write(f"{num_read} customer(s) read.")
        if failed:
            raise CommandError(f"{len(failed)} customer(s) could not be read (logged), run it again: {', '.join(failed)}")
