from django.apps import AppConfig


class ActivityConfig(AppConfig):
    """The persistent per-request activity log (filled by the activity-log issue)."""

    name = "activity"
    verbose_name = "Activity"
