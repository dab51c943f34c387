"""Management API for endpoints and model credentials: `/api/v1/endpoints/`, `/api/v1/credentials/`."""

from django.db import transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from controlplane.accounts.api import OrganizationScopedMixin
from controlplane.accounts.models import Role
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.tenancy import request_membership
from controlplane.integrity import RowLockedUpdateMixin, again_after_deadlocks
from endpoints import adapters, credentials, services
from endpoints import quotas as endpoint_quotas
from endpoints import stats as endpoint_stats
from endpoints.models import Adapter, Endpoint, ModelCredential, shown_replicas_prefetch
from endpoints.quotas import use_of
from endpoints.serializers import (
    AdapterSerializer,
    CredentialSerializer,
    EndpointDetailSerializer,
    EndpointEventSerializer,
    EndpointSerializer,
    QuotaUseSerializer,
)


class EndpointViewSet(RowLockedUpdateMixin, OrganizationScopedMixin, viewsets.ModelViewSet):
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return Endpoint.objects.for_org(self.organization).prefetch_related(*shown_replicas_prefetch())

    def get_serializer_class(self):
        return EndpointSerializer if self.action == "list" else EndpointDetailSerializer

    def perform_create(self, serializer):
        serializer.instance = services.create_endpoint(self.actor, self.organization, **serializer.validated_data)

    def update(self, request, *args, **kwargs):
        # NOTE: the organisation's row before the endpoint's (`RowLockedUpdateMixin`), as `services.update_endpoint`
        # takes them: never waited for with the endpoint's row held, which a node's heartbeat may need.
        return again_after_deadlocks(lambda: self._update(request, *args, **kwargs),
                                     wait_for=lambda: services.wait_for_endpoint_row(kwargs["pk"]))

    def _update(self, request, *args, **kwargs):
        with transaction.atomic():
            endpoint_quotas.lock_organization(self.organization.pk)
            return super().update(request, *args, **kwargs)

    def perform_update(self, serializer):
        serializer.instance = services.update_endpoint(self.actor, serializer.instance, **serializer.validated_data)

    def perform_destroy(self, endpoint):
        services.delete_endpoint(self.actor, endpoint)

    def _fresh(self, endpoint):
        # NOTE: a 404, as for an unknown id, when a delete committed since the write (a `.get`: a 500)
        fresh = get_object_or_404(self.get_queryset(), pk=endpoint.pk)
        return Response(EndpointDetailSerializer(fresh, context=self.get_serializer_context()).data)

    @extend_schema(request=None, responses=EndpointDetailSerializer)
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._fresh(services.pause_endpoint(self.actor, self.get_object()))

    @extend_schema(request=None, responses=EndpointDetailSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._fresh(services.resume_endpoint(self.actor, self.get_object()))

    @extend_schema(responses=EndpointEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        endpoint = self.get_object()
        page = self.paginate_queryset(endpoint.events.all())
        return self.get_paginated_response(EndpointEventSerializer(page, many=True).data)

    @extend_schema(parameters=[endpoint_stats.StatsQuerySerializer],
                   responses=inline_serializer("EndpointStats", {"results": endpoint_stats.DayStatsSerializer(many=True)}),
                   description="Per UTC day: TTFT p50/p95, output tokens/s, prefix-cache hit rate, effective cost "
                               "per million tokens; staff also see GPU-seconds used against billed.")
    @action(detail=True, methods=["get"])
    def stats(self, request, pk=None):
        endpoint = self.get_object()
        query = endpoint_stats.StatsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        rows = endpoint_stats.daily(endpoint, start=query.validated_data["start"], end=query.validated_data["end"],
                                    staff=has_staff_powers(request.user))
        return Response({"results": endpoint_stats.DayStatsSerializer(rows, many=True).data})

    @extend_schema(responses=inline_serializer("EndpointColdStarts", {"results": endpoint_stats.ColdStartSerializer(many=True)}),
                   description="The latest requests that waited for a cold start, with the wait split by phase.")
    @action(detail=True, methods=["get"], url_path="cold-starts")
    def cold_starts(self, request, pk=None):
        rows = endpoint_stats.recent_cold_starts(self.get_object())
        return Response({"results": endpoint_stats.ColdStartSerializer(rows, many=True).data})


class CredentialViewSet(RowLockedUpdateMixin, OrganizationScopedMixin, viewsets.ModelViewSet):
    """Your organisation's credentials for model sources. Secrets are write-only: no answer ever
    contains them; `secrets_set` names the ones stored. Members read (to pick one for an endpoint);
    admins and owners create, replace and delete."""

    serializer_class = CredentialSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    required_role = Role.ADMIN
    required_read_role = Role.MEMBER

    def get_queryset(self):
        return ModelCredential.objects.filter(organization=self.organization).select_related("created_by")

    def perform_create(self, serializer):
        serializer.instance = credentials.create_credential(self.actor, self.organization, **serializer.validated_data)

    # NOTE: no organisation's row taken, as `EndpointViewSet.update` takes it: a credential's edit locks no endpoint
    # nor counts a quota. With it, the edit waited behind a key revocation (seconds) for nothing.

    def perform_update(self, serializer):
        serializer.instance = credentials.update_credential(self.actor, serializer.instance, **serializer.validated_data)

    def perform_destroy(self, credential):
        try:
            credentials.delete_credential(self.actor, credential)
        except credentials.CredentialInUse as exc:
            raise ValidationError({"endpoints": [str(exc)]}) from None

class AdapterViewSet(OrganizationScopedMixin, mixins.ListModelMixin, mixins.CreateModelMixin,
                     mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """`/api/v1/endpoints/{endpoint_id}/adapters/`: the endpoint's LoRA adapters (create, list, delete).
    Another organisation's endpoint is a 404."""

    serializer_class = AdapterSerializer

    def _endpoint(self):
        if not hasattr(self, "_endpoint_row"):
            self._endpoint_row = get_object_or_404(Endpoint.objects.for_org(self.organization), pk=self.kwargs["endpoint_pk"])
        return self._endpoint_row

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Adapter.objects.none()
        return Adapter.objects.filter(endpoint=self._endpoint()).select_related("endpoint")

    def get_serializer_context(self):
        context = super().get_serializer_context()
        if not getattr(self, "swagger_fake_view", False):
            context["endpoint"] = self._endpoint()
        return context

    def perform_create(self, serializer):
        serializer.instance = adapters.create_adapter(self.actor, self._endpoint(), **serializer.validated_data)

    def perform_destroy(self, adapter):
        adapters.delete_adapter(self.actor, adapter)


@extend_schema(responses=QuotaUseSerializer)
@api_view(["GET"])
def quotas(request):
    """`/api/v1/quotas/`: the organisation's quotas (its plan's, or the platform's) and what it holds now."""
    organization = request_membership(request).organization
    return Response(QuotaUseSerializer(use_of(organization)).data)
