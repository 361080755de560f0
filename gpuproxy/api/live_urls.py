"""The live API's routes, full paths: the root urlconf `include()`s this at ""."""

from django.urls import path

from gpuproxy.api import live

urlpatterns = [
    path("api/events", live.events_stream),
    path("api/inflight/<str:request_id>/cancel", live.cancel_inflight),
    path("api/performance", live.performance),
    path("api/hardware", live.hardware),
]
