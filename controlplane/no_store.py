"""No page or API answer of the control plane is kept by a browser or a proxy: `Cache-Control: no-store, private`
on every response that does not set its own (static files, served before this, keep theirs).

NOTE: the pages that show a secret once (a new API key, a node's join token) and every page of an account were
kept in the browser's history and back/forward cache: on a shared machine, Back after the owner logged out
showed the new key again.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.utils.cache import add_never_cache_headers


class NoStoreMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return _not_stored(self.get_response(request))

    async def __acall__(self, request):
        return _not_stored(await self.get_response(request))


def _not_stored(response):
    if not response.has_header("Cache-Control"):
        add_never_cache_headers(response)
    return response
