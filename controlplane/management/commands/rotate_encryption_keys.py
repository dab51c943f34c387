"""Re-encrypt every stored secret with the newest key of INFERPLANE_ENCRYPTION_KEYS.

Rotation: put a new key first in INFERPLANE_ENCRYPTION_KEYS (keep the old ones after it), restart,
run this, then drop the old keys. Safe to run twice and while the platform runs: each row is
rewritten only if it still holds the value that was read.
"""

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from controlplane import secrets

BATCH_SIZE = 500


class Command(BaseCommand):
    help = "Re-encrypt every stored secret (controlplane.secrets.ENCRYPTED_FIELDS) with the newest encryption key."

    def handle(self, *args, **options):
        secrets.reset_keys()
        num_unreadable = 0
        for label, field in secrets.ENCRYPTED_FIELDS:
            model = apps.get_model(label)
            num_rotated = 0
            rows = model._default_manager.exclude(**{field: ""}).values_list("pk", field)
            for pk, token in rows.iterator(chunk_size=BATCH_SIZE):
                try:
                    rotated = secrets.rotate(token)
                except secrets.SecretUnreadable:
                    num_unreadable += 1
                    self.stderr.write(f"{label} {pk}: {field} cannot be decrypted with any configured key")
                    continue
                # NOTE: conditional on the value read, so a secret replaced meanwhile is not overwritten.
                num_rotated += model._default_manager.filter(pk=pk, **{field: token}).update(**{field: rotated})
            self.stdout.write(f"{label}.{field}: {num_rotated} re-encrypted")
        if num_unreadable:
            raise CommandError(f"{num_unreadable} secret(s) could not be decrypted; keep the key that encrypted them")
