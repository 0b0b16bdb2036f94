"""The upstream HTTP/1.1 client: byte streams, one connection, the fast path, the pool."""
