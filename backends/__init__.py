"""Pier backends (`pier.backends`). Each one imports only the backend contract and its own folder."""
