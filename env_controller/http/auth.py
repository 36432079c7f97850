"""Credentials of the controller, the worker server and the gateway: bearer tokens by role (a trainer
token; worker tokens per task name, ``*`` for any; one shared token for both roles, as stock AgentRL
workers send it in their controller URL), where a process finds its token (flag, URL, environment),
URLs with their credentials split off or redacted for logs, and the bind rule (loopback by default,
credentials required elsewhere).
"""
from __future__ import annotations

import base64
import binascii
import enum
import hmac
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from env_controller.options import OptionError

logger = logging.getLogger(__name__)

#: environment variable of the shared token (trainer and worker credential at once, for setups with one token)
TOKEN_ENV = "AGENTRL_CONTROLLER_TOKEN"
#: environment variable of the trainer's credential (start, interact, cancel, views)
TRAINER_TOKEN_ENV = "AGENTRL_TRAINER_TOKEN"
#: environment variable of a worker's credential (heartbeats; the controller sends it back on its calls)
WORKER_TOKEN_ENV = "AGENTRL_WORKER_TOKEN"


def split_url_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@`` part, and the password (None when there is none)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url, None
    if "@" not in parts.netloc:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host)), password or None


def redact_url(url: str) -> str:
    """``url`` with any credentials in it replaced: ``http://user:***@host/api``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(token: str | None, *env_names: str) -> str | None:
    """``token`` when given, else the first set variable of ``env_names`` (default
    ``$AGENTRL_CONTROLLER_TOKEN``), else None (empty means None)."""
    if token is None:
        for name in env_names or (TOKEN_ENV,):
            token = os.environ.get(name)
            if token:
                break
    return token or None


def token_ok(token: str | None) -> bool:
    """Whether ``token`` is None or can travel in an ``Authorization`` header as is (printable ASCII, no spaces)."""
    return token is None or (isinstance(token, str) and _TOKEN.fullmatch(token) is not None)


_TOKEN = re.compile(r"[!-~]{1,4096}")


def check_token(token: str | None, key: str) -> None:
    """:class:`~env_controller.options.OptionError` naming the setting ``key`` unless :func:`token_ok` (the
    message never holds the token: it is a credential)."""
    if not token_ok(token):
        raise OptionError(f"{key} must be printable ASCII without spaces (it travels in an Authorization header); "
                          "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")


def pick_token(token: str | None, url: str, what: str) -> tuple[str, str | None]:
    """The URL without credentials and the token to use: ``token`` when given (a warning when the
    URL holds another one), else the URL's password. Sending both makes aiohttp refuse the request."""
    bare, from_url = split_url_credentials(url)
    if from_url is not None and token is not None and from_url != token:
        logger.warning("%s: both a token and credentials in the URL %s; using the token (drop one of them)",
                       what, redact_url(url))
    return bare, token if token is not None else from_url


def check_bind(host: str, secured: object, what: str) -> None:
    """Refuse to serve ``what`` on a non-loopback ``host`` without credentials (ValueError says how)."""
    if not is_loopback(host) and not secured:
        raise ValueError(
            f"{what} bound to {host!r} (not loopback) needs a bearer token: pass --token or set "
            f"${TOKEN_ENV}; or bind --host 127.0.0.1"
        )


class Role(enum.Enum):
    """Who may call a route: the trainer, a worker, either, or anyone (no credential)."""

    TRAINER = "trainer"
    WORKER = "worker"
    ANY = "any"
    OPEN = "open"


#: worker-token key that allows every task name
ANY_TASK = "*"


@dataclass(frozen=True)
class Identity:
    """What a request's credential allows: the trainer API, and the task names it may serve as a worker."""

    trainer: bool
    tasks: frozenset[str]
    token: str | None = field(default=None, repr=False)

    @property
    def worker(self) -> bool:
        """Whether it may act as a worker (of at least one task)."""
        return bool(self.tasks)

    def may_serve(self, name: str) -> bool:
        """Whether it may register as a worker of task ``name``."""
        return ANY_TASK in self.tasks or name in self.tasks


#: the identity of every request when no credential is configured
OPEN_IDENTITY = Identity(trainer=True, tasks=frozenset({ANY_TASK}))


@dataclass(frozen=True)
class Credentials:
    """The tokens a server accepts: ``trainer`` (None: no trainer credential) and ``workers``, task
    name (or ``*`` for any) to token. With none at all every request is allowed (loopback use)."""

    trainer: str | None = field(default=None, repr=False)
    workers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def single(cls, token: str | None) -> Credentials:
        """One token for every role (the controller's shared ``--token``, and our worker server's)."""
        return cls(token, {ANY_TASK: token} if token else {})

    @property
    def enabled(self) -> bool:
        """Whether any credential is required."""
        return bool(self.trainer or self.workers)

    def identify(self, header: str | None) -> Identity | None:
        """The identity an ``Authorization`` header proves (Bearer, or Basic with the token as
        password, as stock AgentRL workers send it from URL credentials); None when it proves none."""
        presented = _presented_token(header)
        if presented is None:
            return None
        given = presented.encode()
        trainer = bool(self.trainer) and hmac.compare_digest(given, self.trainer.encode())  # type: ignore[union-attr]
        tasks = frozenset(name for name, tok in self.workers.items() if hmac.compare_digest(given, tok.encode()))
        if not trainer and not tasks:
            return None
        return Identity(trainer, tasks, presented)


def _presented_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    scheme = scheme.lower()
    value = value.strip()
    if scheme == "bearer":
        return value or None
    if scheme == "basic":  # stock AgentRL workers can only embed it in the URL: http://agentrl:TOKEN@host/api
        try:
            _, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or None
    return None
