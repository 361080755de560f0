"""The dashboard's pages under /dashboard/ (the overview stays at `/`): one line per page,
each `path("<name>", <module>.page, name="dashboard-<name>")`."""

from django.urls import URLPattern, path

from dashboard.pages import about, activity, captures, logs, performance, playground

urlpatterns: list[URLPattern] = [
    path("activity", activity.page, name="dashboard-activity"),
    path("performance", performance.page, name="dashboard-performance"),
    path("performance/data", performance.data, name="dashboard-performance-data"),
    path("logs", logs.page, name="dashboard-logs"),
    path("logs/feed", logs.feed, name="dashboard-logs-feed"),
    path("captures", captures.page, name="dashboard-captures"),
    path("captures/list", captures.listing, name="dashboard-captures-listing"),
    path("captures/<int:log_id>", captures.detail, name="dashboard-captures-detail"),
    path("about", about.page, name="dashboard-about"),
    path("playground", playground.page, name="dashboard-playground"),
]
