from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    """Model definitions, groups, proxy settings and (later) the scheduler core."""

    name = "scheduling"
    verbose_name = "Scheduling"
