"""Pagination of the management API's lists: `?limit=&offset=`, bounded."""

from rest_framework import pagination

MAX_PAGE_SIZE = 1000


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    """DRF's limit/offset pagination with a largest page.

    NOTE: without `max_limit`, `?limit=9223372036854775809` reaches PostgreSQL as a LIMIT past
    bigint (a 500). A larger limit is clamped, as DRF does; an offset past the end is an empty page
    before any query is built, and a value that is not a positive integer means the default.
    """

    max_limit = MAX_PAGE_SIZE
    limit_query_description = f"Number of results to return per page (at most {MAX_PAGE_SIZE})."
