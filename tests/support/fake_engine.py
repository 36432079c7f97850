"""The weight-update half of the engine protocol for fast tests' fake engines: a version, a pause flag, updates."""
from __future__ import annotations

from typing import Any


class UpdatableEngine:
    """Pause, resume and the weight update of the engine protocol, kept as state (``version``, ``paused``,
    ``pending``); a fake engine derives from it and writes its own ``generate``."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.paused = False
        self.pending: int | None = None

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def begin_weight_update(self, version: int, metadata: dict[str, Any]) -> None:
        self.pending = version

    def receive_bucket(self, named: Any) -> None:
        pass

    def end_weight_update(self) -> None:
        self.version, self.pending = self.pending, None

    def health(self) -> dict[str, Any]:
        return {"ok": True, "version": self.version}
