"""The Activity page (/dashboard/activity): the request log as a table with paging, sorting,
a column chooser and filters, the window's latency cards, charts, and one request's timeline.

The page reads `/dashboard/activity/rows` and `/dashboard/activity/stats`
(gpuproxy/api/activity.py `page_data`: the same queries as `/api/activity` and
`/api/activity/stats`, for a staff session, since the page never holds an API key).
"""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from activity import outcomes
from dashboard import nav


@staff_member_required
def page(request: HttpRequest) -> HttpResponse:
    """The frame (staff only: the admin's login); activity.js fills it."""
    return render(request, "dashboard/activity.html",
                  {"outcomes": outcomes.ALL, "bands": ("interactive", "normal", "batch"),
                   **nav.context(request)})
