"""The playground (/dashboard/playground): chat with a model as a client would, try the other
inference endpoints, and fire a load test whose timeline shows the scheduler at work.

The page calls /v1/* from the browser with the person's session and the CSRF token from the
frame's own form; it never holds an API key (gpuproxy/proxy/staff_session.py says when the
proxy accepts that). Models and their load state come over the dashboard's WebSocket.
"""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from dashboard import nav


@staff_member_required
def page(request: HttpRequest) -> HttpResponse:
    """Staff only (the admin's login): the page spends the proxy's GPUs."""
    return render(request, "dashboard/playground.html",
                  {"ws_path": "/ws/dashboard", **nav.context(request)})
