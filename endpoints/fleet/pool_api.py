"""`/api/v1/fleet/pools/`: node pools for staff (list, create, read, change, delete) with their cost truth.

Staff signed in only, through a session that passed the second factor (never an API key): anyone else gets a 404, as if the route did not exist
(a 403 would confirm it does).
Rules live in `endpoints.fleet.pool_services`; this module shapes and parses.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import BasePermission

from billing.serializers import DatePeriodSerializer
from controlplane import parsers
from controlplane.accounts.models import ApiKey
from controlplane.accounts.second_factor import has_staff_powers
from controlplane.accounts.serializers import StrictModelSerializer
from controlplane.accounts.services import Actor
from endpoints.fleet import pool_services
from endpoints.fleet.pool_costs import Period, usage_by_pool
from endpoints.nodes.models import NodePool

MAX_PERIOD_DAYS = 366


class IsStaff(BasePermission):
    """Staff signed in (a session that passed the second factor); everyone else, a staff session without its
    code, and every API key, staff's own included, sees a 404.

    NOTE: staff powers come only with a staff session, which ends `INFERPLANE_STAFF_SESSION_HOURS` after its
    sign-in (`controlplane.accounts.staff_sessions`). An API key never expires and this route is on the public
    ingress: a staff member's key (or one a stolen staff session minted in any organisation it joined) would
    be the fleet's launch templates for ever.
    """

    def has_permission(self, request, view) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        method = request.method.lower()
        if method not in view.http_method_names or not hasattr(view, method):
            return True  # NOTE: a method the route does not take is its 405, for anyone
        if not has_staff_powers(request.user) or isinstance(request.auth, ApiKey):
            raise NotFound()
        return True


class PoolPeriodSerializer(DatePeriodSerializer):
    """`?start=YYYY-MM-DD&end=YYYY-MM-DD` (inclusive, UTC; default: this month) for the usage figures."""

    max_days_apart = MAX_PERIOD_DAYS - 1  # at most MAX_PERIOD_DAYS days, counting both ends

    @property
    def period(self) -> Period:
        return Period.of_days(self.validated_data["start"], self.validated_data["end"])


class PoolUsageSerializer(serializers.Serializer):
    period_start = serializers.DateTimeField(source="period.start")
    period_end = serializers.DateTimeField(source="period.end", help_text="Exclusive.")
    node_hours = serializers.FloatField(help_text="Machine-hours paid for in the period (requested to terminated).")
    busy_node_hours = serializers.FloatField(help_text="Of them, hours with at least one active replica.")
    idle_node_hours = serializers.FloatField(help_text="Of them, hours booting or empty.")
    cost = serializers.DecimalField(max_digits=20, decimal_places=4, help_text="node_hours × hourly_price.")
    busy_cost = serializers.DecimalField(max_digits=20, decimal_places=4)
    idle_cost = serializers.DecimalField(max_digits=20, decimal_places=4, help_text="What idle machines cost.")


class NodePoolSerializer(StrictModelSerializer):
    num_live = serializers.IntegerField(source="usage.num_live", read_only=True,
                                        help_text="Machines paid for now: requested, launching, joined or releasing.")
    num_booting = serializers.IntegerField(source="usage.num_booting", read_only=True,
                                           help_text="Of them, requested or launching (not joined yet).")
    usage = PoolUsageSerializer(read_only=True, help_text="Node-hours and cost in the period asked for (default: this month).")
    template = parsers.JSONField(required=False, help_text="The provider's machine template (a JSON object).")
    gpus_per_node = serializers.IntegerField(required=False, min_value=0, max_value=pool_services.MAX_GPUS_PER_NODE,
                                             help_text="Default 1 (0 for the cpu GPU type).")
    gpu_memory_mb = serializers.IntegerField(required=False, min_value=0, max_value=pool_services.MAX_GPU_MEMORY_MB,
                                             help_text="Per GPU; default (or 0): the GPU type's memory from the catalogue.")

    class Meta:
        model = NodePool
        fields = ["id", "name", *pool_services.POOL_FIELDS[1:], "num_live", "num_booting", "usage",
                  "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]
        extra_kwargs = {
            "name": {"validators": []},  # uniqueness: the service's rule and message
            "min_nodes": {"max_value": pool_services.MAX_NODES},
            "max_nodes": {"max_value": pool_services.MAX_NODES},
            "warm_nodes": {"max_value": pool_services.MAX_NODES},
            "idle_timeout_s": {"min_value": 1, "max_value": pool_services.MAX_DURATION_S},
            "join_deadline_s": {"min_value": 1, "max_value": pool_services.MAX_DURATION_S},
            "hourly_price": {"min_value": 0, "max_value": pool_services.MAX_HOURLY_PRICE},
        }


PERIOD = extend_schema(parameters=[PoolPeriodSerializer])
# A staff session only (`IsStaff`): an API key is authenticated only to be answered a 404.
SESSION_ONLY = extend_schema(auth=[{"cookieAuth": []}])


@SESSION_ONLY
@extend_schema_view(list=PERIOD, retrieve=PERIOD, destroy=extend_schema(responses={
    204: None, 400: OpenApiResponse(description="The pool still has live machines."),
}))
class NodePoolViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, mixins.RetrieveModelMixin,
                      mixins.UpdateModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Node pools (staff only): machines of one shape the fleet launches on demand and releases when idle."""

    serializer_class = NodePoolSerializer
    permission_classes = [IsStaff]
    queryset = NodePool.objects.all()
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    staff_only = True  # the schema documents its 404 (`controlplane.schema`)

    def _period(self) -> Period:
        if self.request.method != "GET":
            return Period.this_month()
        query = PoolPeriodSerializer(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        return query.period

    def _with_usage(self, pools: list[NodePool]) -> list[NodePool]:
        usage = usage_by_pool(pools, self._period())
        for pool in pools:
            pool.usage = usage[pool.pk]
        return pools

    def paginate_queryset(self, queryset):
        page = super().paginate_queryset(queryset)
        return None if page is None else self._with_usage(list(page))

    def get_object(self):
        return self._with_usage([super().get_object()])[0]

    @property
    def actor(self) -> Actor:
        return Actor.from_request(self.request)

    def _saved(self, pool: NodePool) -> NodePool:
        return self._with_usage([pool])[0]

    def perform_create(self, serializer):
        try:
            serializer.instance = self._saved(pool_services.create_node_pool(self.actor, **serializer.validated_data))
        except pool_services.PoolInvalid as exc:
            raise ValidationError(exc.errors) from None

    def perform_update(self, serializer):
        try:
            serializer.instance = self._saved(
                pool_services.update_node_pool(self.actor, serializer.instance, **serializer.validated_data))
        except pool_services.PoolInvalid as exc:
            raise ValidationError(exc.errors) from None

    def perform_destroy(self, pool):
        try:
            pool_services.delete_node_pool(self.actor, pool)
        except pool_services.PoolInUse as exc:
            raise ValidationError({"launches": [str(exc)]}) from None
