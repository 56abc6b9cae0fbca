"""Showing what accelsched does: the dashboard page, the Prometheus metrics, the status table."""
