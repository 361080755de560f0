"""The dashboard page: a static frame for staff; its data comes over the WebSocket
`/ws/dashboard` (dashboard/consumer.py)."""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


@staff_member_required
def page(request: HttpRequest) -> HttpResponse:
    """The live dashboard (staff only: the admin's login)."""
    return render(request, "dashboard/dashboard.html", {"ws_path": "/ws/dashboard"})
