"""Which ASGI app answers which request.

Every request and WebSocket handshake first passes the exposure policy (gpuproxy/proxy/exposure.py:
the Host allow-list, the Origin check, CORS preflights). Then the OpenAI-compatible paths,
`/v1/models` and `/upstream/...` go to `ProxyConsumer` with no Django middleware in the way;
everything else (admin, the dashboard page, the management API) is Django. The one WebSocket,
`/ws/dashboard`, needs the Django session (staff only) and an Origin of this host (checked by
the consumer), so a page elsewhere cannot drive it with a staff member's cookie.
"""

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from dashboard.consumer import DashboardConsumer
from gpuproxy.proxy.consumers import ProxyConsumer
from gpuproxy.proxy.exposure import CorsHeaders, ExposureMiddleware
from gpuproxy.proxy.inference import PROXY_PATTERN


def build_application(django_asgi_app):
    proxy = ProxyConsumer.as_asgi()
    return ExposureMiddleware(ProtocolTypeRouter({
        "http": URLRouter([
            re_path(PROXY_PATTERN, proxy),
            re_path(r"", CorsHeaders(django_asgi_app)),
        ]),
        "websocket": AuthMiddlewareStack(URLRouter([
            re_path(r"^ws/dashboard$", DashboardConsumer.as_asgi()),
        ])),
    }))
