"""Console pages for endpoints."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from endpoints.models import Endpoint


@login_required
def dashboard(request):
    membership = request.membership
    endpoints = Endpoint.objects.for_org(membership.organization).prefetch_related("replicas") if membership else []
    return render(request, "endpoints/dashboard.html", {"endpoints": endpoints})
