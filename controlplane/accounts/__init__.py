"""Accounts: organisations, members, invitations, API keys, plans, the audit log, and which
organisation and role a request acts in. Every app depends on this one; it depends on no app."""
