"""The dashboard's pages other than the overview, one module each (dashboard/urls.py routes
them under /dashboard/; dashboard/nav.py lists them in the header)."""
