"""The dashboard's overview page: a static frame for staff; its data comes over the WebSocket
`/ws/dashboard` (dashboard/consumer.py). Other pages live in `dashboard/pages/`."""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard import nav


@staff_member_required
def page(request: HttpRequest) -> HttpResponse:
    """The live overview (staff only: the admin's login)."""
    return render(request, "dashboard/dashboard.html",
                  {"ws_path": "/ws/dashboard", **nav.context(request)})
