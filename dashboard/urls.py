"""The dashboard's pages under /dashboard/ (the overview stays at `/`): one line per page,
each `path("<name>", <module>.page, name="dashboard-<name>")`."""

from django.urls import URLPattern, path

from dashboard.pages import activity, performance

urlpatterns: list[URLPattern] = [
    path("activity", activity.page, name="dashboard-activity"),
    path("performance", performance.page, name="dashboard-performance"),
    path("performance/data", performance.data, name="dashboard-performance-data"),
]
