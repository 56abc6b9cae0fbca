"""Seeing what accelsched does: the dashboard page and the Prometheus metrics."""
