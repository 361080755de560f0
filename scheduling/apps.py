from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    """Model definitions, groups, proxy settings, the scheduler core, and the signals that
    apply a committed change to the running proxy."""

    name = "scheduling"
    verbose_name = "Scheduling"

    def ready(self) -> None:
        from scheduling import signals

        signals.connect()
