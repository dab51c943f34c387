"""The Content-Security-Policy every page of the control plane is served with (`CONTENT_SECURITY_POLICY`).

The console loads only its own files (templates, `static/`: htmx, uPlot, its own scripts; no inline script,
no `eval`), so a script that got into a page through some tenant's text (an endpoint's name, a failure reason
an engine wrote, a model's config) would not run: `script-src 'self'`. Styles may be inline (the progress bars'
widths, htmx's indicator style, the API docs' page). Nothing may frame a page. A response that already
carries a policy keeps its own.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings

HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.policy = settings.CONTENT_SECURITY_POLICY
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self._with_policy(self.get_response(request))

    async def __acall__(self, request):
        return self._with_policy(await self.get_response(request))

    def _with_policy(self, response):
        if self.policy and HEADER not in response:
            response[HEADER] = self.policy
        return response
