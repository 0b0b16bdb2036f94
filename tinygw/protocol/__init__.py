"""The APIs' wire formats: request bodies and headers, server-sent events, usage, routes."""
