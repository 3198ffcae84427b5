"""Per-version model states, as the repository index reports them."""

from __future__ import annotations

import enum


class ModelState(enum.Enum):
    UNKNOWN = "UNKNOWN"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
