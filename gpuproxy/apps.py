from django.apps import AppConfig


class GpuproxyConfig(AppConfig):
    """The project itself is an app so that `serve` is a management command."""

    name = "gpuproxy"
    verbose_name = "gpuproxy"

    def ready(self) -> None:
        from gpuproxy.observe import metrics

        metrics.register()
