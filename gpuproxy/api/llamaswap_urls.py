"""llama-swap's read API and UI paths, full paths: the root urlconf `include()`s this at ""."""

from django.urls import path, re_path

from gpuproxy.api import llamaswap as views

urlpatterns = [
    path("api/metrics/activity", views.activity),
    path("api/metrics/stats", views.stats),
    path("api/version", views.version),
    re_path(r"^ui(?:/(?P<rest>.*))?$", views.to_dashboard),
    path("upstream", views.to_dashboard),
]
