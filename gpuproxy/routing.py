"""Which ASGI app answers which request.

The OpenAI-compatible paths, `/v1/models` and `/upstream/...` go to `ProxyConsumer` with no
Django middleware in the way; everything else (admin, the management API) is Django.
"""

from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from gpuproxy.consumers import ProxyConsumer
from gpuproxy.inference import INFERENCE_PATHS

PROXY_PATTERN = "^(" + "|".join(sorted(
    p.lstrip("/").replace(".", r"\.") for p in INFERENCE_PATHS | {"/v1/models", "/models"}
)) + r")$|^upstream/"


def build_application(django_asgi_app):
    proxy = ProxyConsumer.as_asgi()
    return ProtocolTypeRouter({
        "http": URLRouter([
            re_path(PROXY_PATTERN, proxy),
            re_path(r"", django_asgi_app),
        ]),
    })
