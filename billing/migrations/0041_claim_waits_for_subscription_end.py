"""A rollup's push claim is refused by the database while its organisation's subscription is being cancelled after its
close (`BillingAccount.subscription_ending_at`, `billing.closed_subscriptions`): a trigger on the claim's own
`UPDATE ... WHERE` leaves the row as it was, so the claim takes no row and its push waits for the next subscription.

NOTE: in the database, not in `stripe_sync.push_rollup`: workers of the release before billing/0040 push during a
rolling deploy (and after a rollback), and they never read the mark. Each claims with the same statement
(`UPDATE billing_usagerollup SET push_claimed_at = CLOCK_TIMESTAMP() WHERE id = ... AND <claimable>`), which now
changes no row under the mark: they answer "another worker won it" and push nothing. Before, such a worker pushed a
rollup made while the run cancelled the subscription to it, seconds before its final invoice or after it: billed by
no invoice, and marked pushed.

Only a claim is refused: a row taking `push_claimed_at` anew, not pushed and not held for an operator (a held
rollup's difference run stamps its own claims); a claim cleared, a push recorded, every other write go through. A
mark left on an account without a subscription refuses nothing (as `stripe_sync._subscription_ending`). Run again
(`CREATE OR REPLACE`, `DROP TRIGGER IF EXISTS`), it changes nothing.
"""

from django.db import migrations

_FUNCTION = "billing_rollup_claim_waits_for_subscription_end"

_CREATE = f"""
CREATE OR REPLACE FUNCTION {_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM billing_billingaccount
               WHERE organization_id = NEW.organization_id
                 AND subscription_ending_at IS NOT NULL AND stripe_subscription_id <> '') THEN
        RETURN NULL;  -- the row is left as it was: the claim takes no row
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS {_FUNCTION} ON billing_usagerollup;
CREATE TRIGGER {_FUNCTION}
    BEFORE UPDATE OF push_claimed_at ON billing_usagerollup
    FOR EACH ROW
    WHEN (NEW.push_claimed_at IS NOT NULL AND NEW.push_claimed_at IS DISTINCT FROM OLD.push_claimed_at
          AND NEW.pushed_at IS NULL AND NEW.push_held_at IS NULL)
    EXECUTE FUNCTION {_FUNCTION}();
"""

_DROP = f"""
DROP TRIGGER IF EXISTS {_FUNCTION} ON billing_usagerollup;
DROP FUNCTION IF EXISTS {_FUNCTION}();
"""


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0040_subscription_ending_at"),
    ]

    operations = [
        migrations.RunSQL(_CREATE, _DROP),
    ]
