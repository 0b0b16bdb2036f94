"""The per-worker gateway, the attempt loop of one request, discovery and health checks."""
