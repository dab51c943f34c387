"""The Celery application: worker and beat share it.

    celery -A controlplane worker   # autoscaling, placement, rollups, Stripe sync
    celery -A controlplane beat     # the clock (exactly one)
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("inferplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
