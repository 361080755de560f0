"""The dashboard's pages, in the header's order: (URL name, label). One list, read by every
page's frame (dashboard/templates/dashboard/base.html) through `context`."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

PAGES: list[tuple[str, str]] = [
    ("dashboard", "Overview"),
    ("dashboard-activity", "Activity"),
    ("dashboard-performance", "Performance"),
    ("dashboard-logs", "Logs"),
    ("dashboard-captures", "Captures"),
    ("dashboard-about", "About"),
    ("dashboard-playground", "Playground"),
]


def context(request: HttpRequest) -> dict[str, Any]:
    """The template context every dashboard page adds to its own."""
    return {"dashboard_pages": PAGES}
