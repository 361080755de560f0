"""The ASGI application Daphne serves: one ProtocolTypeRouter (routes in `gpuproxy/routing.py`)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuproxy.settings")
# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from gpuproxy.routing import build_application  # noqa: E402

application = build_application(django_asgi_app)
