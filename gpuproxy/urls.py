"""Django's URL routes: admin and the JSON/plain-text management API.

Streaming routes (`/logs/stream...`) are raw ASGI apps in `gpuproxy/routing.py`, so a client
that leaves is noticed at once.
"""

from django.contrib import admin
from django.urls import path, re_path

from gpuproxy import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("health", views.health),
    path("running", views.running),
    re_path(r"^api/models/load/(?P<model>.+)$", views.load_model),
    path("api/models/unload", views.unload_all),
    re_path(r"^api/models/unload/(?P<model>.+)$", views.unload_model),
    path("unload", views.unload_all_legacy),
    path("logs", views.logs),
]
