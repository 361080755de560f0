"""The activity API's routes, full paths: the root urlconf `include()`s this at ""."""

from django.urls import path

from gpuproxy.api import activity as views

urlpatterns = [
    path("api/activity", views.activity_list),
    path("api/activity/stats", views.activity_stats),
    # the dashboard's Activity page (dashboard/pages/activity.py), for a staff session
    path("dashboard/activity/<str:what>", views.page_data, name="dashboard-activity-data"),
]
