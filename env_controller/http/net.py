"""Network helpers shared by every package (env_controller is the lowest layer)."""
from __future__ import annotations

import ipaddress
import socket


def is_host(value: str) -> bool:
    """'' or a bare host: a name or IPv4 address (no scheme, port, path or spaces), or an IPv6 address."""
    if not value:
        return True
    if ":" in value:
        try:
            ipaddress.IPv6Address(value.strip("[]"))
            return True
        except ValueError:
            return False
    return not any(c.isspace() or c in "/@?#" for c in value)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it).

    ``host``: an IPv4 or IPv6 address, or ``""`` / ``"0.0.0.0"`` for every interface. The port is
    released before returning, so another process may take it before the caller binds it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def address_towards(host: str, port: int = 9) -> str:
    """The address of this machine that ``host`` reaches it by: the source address the OS routes to
    ``host`` from (no packet is sent). ``127.0.0.1`` for loopback hosts; OSError when ``host`` does
    not resolve or no route leads there.
    """
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: picks the route and source address, sends nothing
        return str(s.getsockname()[0])
