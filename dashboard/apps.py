from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The operator's live page and its WebSocket: an app so that its template and static
    files are found like any Django app's."""

    name = "dashboard"
    verbose_name = "dashboard"
