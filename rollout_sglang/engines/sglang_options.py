"""Our settings of an SGLang engine (:class:`~rollout_sglang.engines.sglang_client.SGLangEngine`): how its
client calls the server, and how :meth:`~rollout_sglang.engines.sglang_client.SGLangEngine.launch` starts one.
SGLang's own request bodies are not settings: its source fixes them."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from env_controller.options import Options

#: SGLang's pause modes (``/pause_generation {"mode"}``)
PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class SGLangClientOptions(Options):
    """Timeouts, pause mode and keys of the client of one SGLang server (times in seconds)."""

    KEY = "sglang"
    CHOICE_HINTS = {"pause_mode": "SGLang's modes; 'abort' is safe: the version pool drains a slot before pausing it"}

    #: limit on one ``/generate`` call
    request_timeout_s: float = 600.0
    #: limit on pause, continue, flush and health calls
    control_timeout_s: float = 60.0
    #: default limit on each weight-update call (a caller may give its own)
    update_timeout_s: float = 600.0
    #: SGLang's pause mode; the version pool drains the slot first, so nothing is in flight when it pauses
    pause_mode: PauseMode = "abort"
    #: the server's ``--api-key``, sent as ``Authorization: Bearer`` with every request (None: none)
    api_key: str | None = field(default=None, repr=False)
    #: the server's ``--admin-api-key``, sent instead of ``api_key`` on the control endpoints SGLang marks
    #: ``ADMIN_OPTIONAL`` (pause, continue, flush, the weight-update calls)
    admin_api_key: str | None = field(default=None, repr=False)

    def check(self) -> None:
        """Timeouts are positive seconds (the pause mode is one of SGLang's: the base checks it)."""
        super().check()
        self.require_seconds("request_timeout_s", "control_timeout_s", "update_timeout_s")


@dataclass
class SGLangLaunchOptions(Options):
    """How :meth:`~rollout_sglang.engines.sglang_client.SGLangEngine.launch` starts an SGLang server process."""

    KEY = "sglang_launch"

    #: the address the server binds (``0.0.0.0``: every interface; the client then calls it on loopback)
    host: str = "127.0.0.1"
    #: the port the server binds (None or 0: a free one)
    port: int | None = None
    #: SGLang's ``--dtype``
    dtype: str = "auto"
    #: SGLang's ``--mem-fraction-static`` (None: SGLang's default)
    mem_fraction_static: float | None = None
    #: more SGLang flags, appended as given
    extra_args: tuple[str, ...] = ()
    #: limit on the server becoming healthy (model load, CUDA graph capture); it is killed after it
    startup_timeout_s: float = 900.0
    #: where the server's output goes (``sglang_<port>.log``; None: a fresh temporary directory)
    log_dir: str | os.PathLike[str] | None = None
    #: the Python that runs the server
    python: str = sys.executable
    #: the module run as ``python -m`` (tests launch the stand-in the same way)
    server_module: str = "sglang.launch_server"
    #: MoE models: start the server with ``--enable-return-routed-experts`` (routed-experts capture)
    capture_routing: bool = False

    def check(self) -> None:
        """A port in range, a positive startup limit, a memory fraction in (0, 1]."""
        super().check()
        if self.port is not None:
            self.require_int("port", 0, 65535, why="None or 0 picks a free port")
        self.require_seconds("startup_timeout_s")
        if self.mem_fraction_static is not None:
            v = self.mem_fraction_static
            self.require(isinstance(v, (int, float)) and 0 < v <= 1, "mem_fraction_static",
                         "must be in (0, 1] (the share of GPU memory for weights and KV cache), or None")
