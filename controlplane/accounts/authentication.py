"""DRF authentication by API key: `Authorization: Bearer ip_…`."""

from rest_framework import authentication, exceptions

from controlplane.accounts.keys import authenticate_api_key
from controlplane.credential_lookups import LookupsBusy


class KeyLookupsBusy(exceptions.APIException):
    """Every key-lookup slot stayed taken (a flood of new keys): a 503 that says when to retry."""

    status_code = 503
    default_detail = "Too many API keys are being checked at once; retry in a moment."
    default_code = "key_lookups_busy"
    wait = 1  # NOTE: DRF's exception handler sends it as Retry-After.


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        keyword, _, plain = header.partition(" ")
        if keyword != self.keyword or not plain.strip():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <API key>'.")
        try:
            api_key = authenticate_api_key(plain.strip())
        except LookupsBusy:
            raise KeyLookupsBusy() from None
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked API key.")
        return api_key.created_by, api_key

    def authenticate_header(self, request):
        return self.keyword


try:
    from drf_spectacular.extensions import OpenApiAuthenticationExtension
except ImportError:  # pragma: no cover - the schema generator is always installed with the control plane
    OpenApiAuthenticationExtension = None

if OpenApiAuthenticationExtension is not None:

    class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
        target_class = "controlplane.accounts.authentication.ApiKeyAuthentication"
        name = "ApiKey"

        def get_security_definition(self, auto_schema):
            return {"type": "http", "scheme": "bearer", "description": "An API key with the 'manage' scope."}
