"""The dashboard's pages under /dashboard/ (the overview stays at `/`): one line per page,
each `path("<name>", <module>.page, name="dashboard-<name>")`."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
