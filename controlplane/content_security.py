"""What every response of the control plane carries for the browser's sake: its Content-Security-Policy, and
`Cache-Control: no-store` where it sets no caching of its own.

The Content-Security-Policy (`CONTENT_SECURITY_POLICY`): the console loads only its own files (templates,
`static/`: htmx, uPlot, its own scripts; no inline script, no `eval`), so a script that got into a page through
some tenant's text (an endpoint's name, a failure reason an engine wrote, a model's config) would not run:
`script-src 'self'`. Styles come only from our own stylesheets too (`style-src 'self'`, no `style` attribute: a
bar's share is SVG geometry, `{% bar_fill %}`; htmx's indicator `<style>` is off; the API docs' page links a stylesheet),
so injected text cannot restyle a page either (hide a warning, draw a fake form over it).
Nothing may frame a page. A response that already carries a policy keeps its own. With it goes a
Permissions-Policy (`PERMISSIONS_POLICY`): camera, microphone, location, payment and device APIs, which no page
uses, are refused to the page and anything in it.

No-store: no page or API answer is kept by a browser or a proxy. NOTE: the pages that show a secret once (a new
API key, a node's join token) and every page of an account were kept in the browser's history and back/forward
cache: on a shared machine, Back after the owner logged out showed the new key again. Static files are served
before this middleware runs (WhiteNoise) and keep their own caching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.utils.cache import add_never_cache_headers

HEADER = "Content-Security-Policy"
PERMISSIONS_HEADER = "Permissions-Policy"


class _OnEveryResponse(ABC):
    """A middleware that only adds to responses, sync or async (`_add`)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self._add(self.get_response(request))

    async def __acall__(self, request):
        return self._add(await self.get_response(request))

    @abstractmethod
    def _add(self, response):
        """`response`, with what this middleware adds."""


class ContentSecurityPolicyMiddleware(_OnEveryResponse):
    def __init__(self, get_response):
        super().__init__(get_response)
        self.policy = settings.CONTENT_SECURITY_POLICY
        self.permissions_policy = settings.PERMISSIONS_POLICY

    def _add(self, response):
        if self.policy and HEADER not in response:
            response[HEADER] = self.policy
        if self.permissions_policy and PERMISSIONS_HEADER not in response:
            response[PERMISSIONS_HEADER] = self.permissions_policy
        return response


class NoStoreMiddleware(_OnEveryResponse):
    def _add(self, response):
        if not response.has_header("Cache-Control"):
            add_never_cache_headers(response)
        return response
