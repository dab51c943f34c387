"""An account whose address was stored before `normalize_email` folded addresses NFKC (sign-up lowered it only:
`ada@\uff45xample.test`, fullwidth, beside its username `ada@example.test`) still accepts an invitation to its
address: every invitation is now stored folded, and compared raw with the account's, none could ever match it."""

import pytest

from controlplane.accounts import invitations, services
from controlplane.accounts.models import Role
from controlplane.accounts.signup import mark_email_verified
from tests.factories import MembershipFactory, OrganizationFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("typed", ["ada@\uff45xample.test", "ada@example.test"])
def test_an_account_stored_unfolded_accepts_an_invitation_to_its_address(typed):
    organization = OrganizationFactory()
    admin = UserFactory()
    MembershipFactory(organization=organization, user=admin, role=Role.OWNER)
    old = UserFactory(username="ada@example.test", email="ada@\uff45xample.test")  # as sign-up stored it before
    mark_email_verified(old)

    invitation = invitations.invite_member(services.Actor(user=admin), organization, email=typed, role=Role.MEMBER)
    assert invitation.email == "ada@example.test"
    assert invitations.invitation_refusal(invitation, old) is None
    membership = invitations.accept_invitation(services.Actor(user=old), invitation)
    assert membership.user == old


def test_another_address_is_still_refused():
    organization = OrganizationFactory()
    admin = UserFactory()
    MembershipFactory(organization=organization, user=admin, role=Role.OWNER)
    other = UserFactory(username="bob@example.test", email="bob@\uff45xample.test")
    mark_email_verified(other)
    invitation = invitations.invite_member(services.Actor(user=admin), organization, email="ada@example.test",
                                           role=Role.MEMBER)
    assert invitations.invitation_refusal(invitation, other) is not None


def test_a_member_stored_unfolded_is_not_invited_again():
    organization = OrganizationFactory()
    admin = UserFactory()
    MembershipFactory(organization=organization, user=admin, role=Role.OWNER)
    old = UserFactory(username="ada@example.test", email="ada@\uff45xample.test")
    MembershipFactory(organization=organization, user=old, role=Role.MEMBER)
    with pytest.raises(invitations.AlreadyInvited, match="already a member"):
        invitations.invite_member(services.Actor(user=admin), organization, email="ada@\uff45xample.test",
                                  role=Role.MEMBER)
