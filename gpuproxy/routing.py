"""Which ASGI app answers which request.

Every request and WebSocket handshake first passes the exposure policy (gpuproxy/proxy/exposure.py:
the Host allow-list, the Origin check, CORS preflights). Then the OpenAI-compatible paths,
`/v1/models` and `/upstream/...` go to `ProxyConsumer` with no Django middleware in the way;
everything else (admin, the dashboard page, the management API) is Django. The one WebSocket,
`/ws/dashboard`, needs the Django session (staff only) and an Origin of this host (checked by
the consumer), so a page elsewhere cannot drive it with a staff member's cookie.
"""

import re

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import re_path

from dashboard.consumer import DashboardConsumer
from gpuproxy.proxy.consumers import ProxyConsumer
from gpuproxy.proxy.exposure import CorsHeaders, ExposureMiddleware
from gpuproxy.proxy.inference import PROXY_PATTERN


class ProxyFirst:
    """The proxy's paths straight to its app; everything else to Channels' routers.

    The same match as a `re_path(PROXY_PATTERN, ...)` in a URLRouter (the path without its
    leading slash), without the router's per-request scope copy and resolver: the proxy path
    is the hot one (BENCHMARKS.md, "Speed")."""

    def __init__(self, proxy, rest) -> None:
        self.proxy = proxy
        self.rest = rest
        self.match = re.compile(PROXY_PATTERN).match

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            if self.match(path[1:] if path.startswith("/") else path):
                return await self.proxy(scope, receive, send)
        return await self.rest(scope, receive, send)


def build_application(django_asgi_app):
    return ExposureMiddleware(ProxyFirst(ProxyConsumer.as_asgi(), ProtocolTypeRouter({
        "http": CorsHeaders(django_asgi_app),
        "websocket": AuthMiddlewareStack(URLRouter([
            re_path(r"^ws/dashboard$", DashboardConsumer.as_asgi()),
        ])),
    })))
