from django.urls import path

from endpoints import views

app_name = "console"

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
]
