"""`replay_rejected_usage`: bill what the files bucket's rejected prefix keeps, once this version can
(`journal_shipping.replay_rejected`): run it after a release that reads what an older one could not, or once a refused
row's cause is put right. Each row is written once, however often it runs."""

from django.core.management.base import BaseCommand, CommandError

from billing import journal_shipping


class Command(BaseCommand):
    help = "Replay the usage lines kept aside in the files bucket (each row written once)."

    def handle(self, *args, **options):
        if not journal_shipping.enabled():
            raise CommandError("Usage journal shipping is off (INFERPLANE_USAGE_JOURNAL_SHIP): no bucket to replay from.")
        num_written, unsigned = journal_shipping.replay_rejected()
        self.stdout.write(f"{num_written} row(s) written into the ledger.")
        for key in unsigned:
            self.stderr.write(f"{key}: not signed by this platform, left as it is (never billed).")
