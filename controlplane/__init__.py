# The Celery app loads with Django so that `shared_task` binds to it.
from controlplane.celery_app import app as celery_app

__all__ = ["celery_app"]
