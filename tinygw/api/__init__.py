"""The ASGI app and the pages it answers."""
