"""URL routes: the admin and the management API (llama-swap's paths)."""

from django.contrib import admin
from django.urls import include, path, re_path

from dashboard import views as dashboard_views
from gpuproxy.api import views

urlpatterns = [
    path("", dashboard_views.page, name="dashboard"),
    path("dashboard/", include("dashboard.urls")),
    path("admin/", admin.site.urls),
    # browsers ask for it on any page (the admin's and the API's too): the dashboard's icon
    path("favicon.ico", dashboard_views.favicon),
    path("health", views.health),
    path("running", views.running),
    re_path(r"^api/models/load/(?P<model>.+)$", views.load_model),
    path("api/models/unload", views.unload_all),
    re_path(r"^api/models/unload/(?P<model>.+)$", views.unload_model),
    path("unload", views.unload_all_legacy),
    path("api/queue", views.queue),
    path("metrics", views.metrics_view),
    path("", include("gpuproxy.api.activity_urls")),
    path("", include("gpuproxy.api.live_urls")),
    path("", include("gpuproxy.api.captures")),
    path("", include("gpuproxy.api.profiles")),
    path("", include("gpuproxy.api.whatif")),
    path("", include("gpuproxy.api.fleet")),
    path("", include("gpuproxy.api.llamaswap_urls")),
    path("logs", views.logs),
    path("logs/stream", views.logs_stream),
    re_path(r"^logs/stream/(?P<which>.+)$", views.logs_stream),
]

handler400 = "gpuproxy.api.views.bad_request"
handler403 = "gpuproxy.api.views.permission_denied"
handler404 = "gpuproxy.api.views.not_found"
handler500 = "gpuproxy.api.views.server_error"
