"""The ASGI application Daphne serves: one ProtocolTypeRouter (routes in `gpuproxy/routing.py`).

Django's part is wrapped in `ASGIStaticFilesHandler` so that `/static/...` (the admin's CSS and
JavaScript, the settings page's guarantees panel) is served by `gpuproxy serve` itself: there is
no web server in front to do it, and `runserver`'s static serving does not apply under Daphne.
"""

import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuproxy.settings")
# Django must be set up before anything imports models.
django_asgi_app = ASGIStaticFilesHandler(get_asgi_application())

from gpuproxy.proxy.guard import SuspiciousGuard  # noqa: E402
from gpuproxy.routing import build_application  # noqa: E402

# django-stubs spells the ASGI callable with Mapping where ours says dict: the same protocol.
application = build_application(SuspiciousGuard(django_asgi_app))  # type: ignore[arg-type]
