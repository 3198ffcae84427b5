"""Pier backends. Each one imports only `backends.base`, `server.types` and `server.errors`."""
