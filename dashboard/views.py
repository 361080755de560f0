"""The dashboard's overview page: a static frame for staff; its data comes over the WebSocket
`/ws/dashboard` (dashboard/consumer.py). Other pages live in `dashboard/pages/`."""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, HttpResponsePermanentRedirect
from django.shortcuts import render
from django.templatetags.static import static
from django.views.decorators.csrf import csrf_exempt

from dashboard import nav
from dashboard.pages.common import json_error


@staff_member_required
def page(request: HttpRequest) -> HttpResponse:
    """The live overview (staff only: the admin's login)."""
    return render(request, "dashboard/dashboard.html",
                  {"ws_path": "/ws/dashboard", **nav.context(request)})


@csrf_exempt  # nothing to protect, and a POST gets the API's 405, not the CSRF page
def favicon(request: HttpRequest) -> HttpResponse:
    """Browsers ask for /favicon.ico on any page (the admin's and the API's too): the
    dashboard's icon."""
    if request.method not in ("GET", "HEAD"):
        response = json_error(405, f"{request.method} is not allowed on {request.path}; "
                                   "use GET", code="method_not_allowed")
        response["Allow"] = "GET, HEAD"
        return response
    return HttpResponsePermanentRedirect(static("dashboard/favicon.svg"))
