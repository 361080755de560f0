"""Which ASGI app answers which request.

Today everything is Django (admin and the management API); the OpenAI-compatible proxy
consumer joins here as a `URLRouter` entry for `/v1/...` without going through Django's
middleware.
"""

from channels.routing import ProtocolTypeRouter


def build_application(django_asgi_app):
    return ProtocolTypeRouter({"http": django_asgi_app})
