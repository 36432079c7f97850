"""The live weight versions of a LoRA run: adapters on the one base every engine of the pool holds.

The version pool (:mod:`rollout_sglang.engines.version_pool`) keeps this record when its versions are adapters:
which versions requests may be routed to, how many requests each has in flight, which are retiring (no new
requests; unloaded once their last request returned), and which adapters each engine has loaded (an engine is
sent a version's requests only when it holds its adapter). The base itself is a version without an adapter: the
first one, before any adapter was published.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rollout_sglang.engines.adapter import Adapter


@dataclass(eq=False)
class LiveVersion:
    """One weight version of the pool: ``adapter`` on the base (None: the base alone), its requests in flight, and
    whether it is retiring."""

    version: int
    adapter: Adapter | None = None
    inflight: int = 0
    retiring: bool = False

    @property
    def name(self) -> str | None:
        """Its adapter's name on the engines (None: the base)."""
        return None if self.adapter is None else self.adapter.name


class AdapterVersions:
    """The live versions of a pool whose versions are adapters (see the module doc).

    live_versions: how many versions requests may be routed to at once (``rollout.max_versions``); one more may be
        loaded while the oldest retires. base_version: the version of the base the engines hold. engine_ids: the
        pool's engines.
    """

    def __init__(self, live_versions: int, base_version: int, engine_ids: Iterable[int]) -> None:
        if live_versions < 1:
            raise ValueError(f"live_versions={live_versions!r} must be >= 1")
        self.live_versions = int(live_versions)
        self.versions: list[LiveVersion] = [LiveVersion(int(base_version))]
        self.loaded: dict[int, set[str]] = {int(e): set() for e in engine_ids}

    def routable(self) -> list[LiveVersion]:
        """The versions new requests may go to, oldest first."""
        return [v for v in self.versions if not v.retiring]

    def holds(self, engine_id: int, live: LiveVersion) -> bool:
        """Whether engine ``engine_id`` can serve ``live`` (it has its adapter; every engine has the base)."""
        return live.name is None or live.name in self.loaded[engine_id]

    def add(self, adapter: Adapter) -> list[LiveVersion]:
        """``adapter`` joins as the newest version; the base alone retires (the adapters carry the policy from the
        first on: after a resume the base is no version the trainer trained), as do the oldest routable versions
        beyond ``live_versions``. The versions that retire."""
        self.versions.append(LiveVersion(int(adapter.version), adapter))
        base = [v for v in self.routable() if v.adapter is None]
        adapters = [v for v in self.routable() if v.adapter is not None]
        retire = base + adapters[:max(0, len(adapters) - self.live_versions)]
        for v in retire:
            v.retiring = True
        return retire

    def drained(self) -> list[LiveVersion]:
        """Retiring versions whose last request returned: ready to be unloaded."""
        return [v for v in self.versions if v.retiring and v.inflight == 0]

    def drop(self, live: LiveVersion) -> None:
        """``live`` was unloaded everywhere: forget it."""
        self.versions.remove(live)
        for names in self.loaded.values():
            names.discard(live.name or "")

    def reset(self, base_version: int) -> list[str]:
        """A new base was loaded: it is the only version; the adapter names that were loaded (to unload)."""
        names = sorted({n for names in self.loaded.values() for n in names})
        self.versions = [LiveVersion(int(base_version))]
        for loaded in self.loaded.values():
            loaded.clear()
        return names

    def describe(self) -> str:
        """E.g. ``v3 (base), v5, v6 retiring (2 in flight)``, for messages."""
        return ", ".join(f"v{v.version}" + (" (base)" if v.adapter is None else "")
                         + (f" retiring ({v.inflight} in flight)" if v.retiring else "") for v in self.versions)
