"""The dashboard's pages under /dashboard/ (the overview stays at `/`): one line per page."""

from django.urls import path

urlpatterns: list = [
]
