"""Sandboxes for built-in tasks: one persistent bash per session, behind one interface.

``make_backend("bwrap")`` (bubblewrap, real on any Linux with user namespaces) or
``make_backend("docker", image=...)`` (containers through the ``docker`` SDK) returns a
:class:`SandboxBackend`; ``backend.create()`` starts a :class:`Sandbox`. See
:mod:`env_controller.sandbox.base` for the contract and the limits.
"""
from __future__ import annotations

from typing import Any

from env_controller.sandbox.base import (
    CommandResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
)

BACKENDS = ("bwrap", "docker")


def make_backend(name: str, limits: SandboxLimits | None = None, **options: Any) -> SandboxBackend:
    """Build the sandbox backend ``name`` (``bwrap`` or ``docker``) with default ``limits``.

    ``options`` go to :class:`~env_controller.sandbox.bwrap.BwrapBackend`'s constructor, or make the
    :class:`~env_controller.sandbox.options.DockerOptions` of a
    :class:`~env_controller.sandbox.docker.DockerBackend` (``client``: a docker client to use). Raises ValueError
    for an unknown name or option and :class:`SandboxUnavailableError` when the backend cannot run here.
    """
    if name == "bwrap":
        from env_controller.sandbox.bwrap import BwrapBackend

        return BwrapBackend(limits, **options)
    if name == "docker":
        from env_controller.options import build_options
        from env_controller.sandbox.docker import DockerBackend
        from env_controller.sandbox.options import DockerOptions

        client = options.pop("client", None)
        return DockerBackend(limits, build_options(DockerOptions, options, "docker"), client=client)
    raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS", "CommandResult", "Sandbox", "SandboxBackend", "SandboxError", "SandboxLimits",
    "SandboxUnavailableError", "make_backend",
]
