from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.utils.functional import SimpleLazyObject

from controlplane.tenancy import session_membership


class CurrentOrganizationMiddleware:
    """Puts the console's current membership on `request.membership`.

    Lazily, since most API calls never ask; async-capable, so the gateway's async
    views pay no thread hop for it.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        request.membership = SimpleLazyObject(lambda: session_membership(request))
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request):
        return await self.get_response(request)
