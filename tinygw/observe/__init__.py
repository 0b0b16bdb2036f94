"""Metrics, the shared metric store, process gauges and the status board."""
