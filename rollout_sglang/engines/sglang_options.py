"""Our settings of an SGLang engine (:class:`~rollout_sglang.engines.sglang_client.SGLangEngine`): how its
client calls the server, and how :meth:`~rollout_sglang.engines.sglang_client.SGLangEngine.launch` starts one.
SGLang's own request bodies are not settings: its source fixes them."""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from env_controller.options import OptionError, Options
from rollout_sglang.engines.sglang_server_args import server_args_argv

#: SGLang's pause modes (``/pause_generation {"mode"}``); the two that hold requests are the engine protocol's
#: :data:`~rollout_sglang.engines.protocol.PauseMode`
SGLangPauseMode = Literal["abort", "retract", "in_place"]
#: what SGLang 0.5.23's ``--lora-target-modules`` accepts (``SUPPORTED_LORA_TARGET_MODULES`` in
#: sglang/srt/utils/common.py, plus ``all``); tests/rollout/test_sglang_lora.py checks it against the wheel
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                       "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud", "all")
#: the Hugging Face projections PEFT's ``all-linear`` adapts on a dense decoder (our trainer's targets)
ALL_LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class SGLangClientOptions(Options):
    """Timeouts, pause mode and keys of the client of one SGLang server (times in seconds)."""

    KEY = "sglang"
    CHOICE_HINTS = {"pause_mode": "SGLang's modes, sent by a drained pause; 'abort' is safe: the version pool drains a "
                                  "slot before pausing it (an in-flight update's pause sends its own mode)"}

    #: limit on one ``/generate`` call
    request_timeout_s: float = 600.0
    #: limit on pause, continue, flush and health calls
    control_timeout_s: float = 60.0
    #: default limit on each weight-update call (a caller may give its own)
    update_timeout_s: float = 600.0
    #: SGLang's pause mode of a drained pause (``pause()`` without a mode): the version pool drained the slot first,
    #: so nothing is in flight when it pauses; an in-flight update's pause (``pause("in_place")`` or
    #: ``pause("retract")``) sends its own mode instead
    pause_mode: SGLangPauseMode = "abort"
    #: the server's ``--api-key``, sent as ``Authorization: Bearer`` with every request (None: none)
    api_key: str | None = field(default=None, repr=False)
    #: the server's ``--admin-api-key``, sent instead of ``api_key`` on the control endpoints SGLang marks
    #: ``ADMIN_OPTIONAL`` (pause, continue, flush, the weight-update calls)
    admin_api_key: str | None = field(default=None, repr=False)
    #: ``/generate`` requests (turns, scorings) this client has open at the server at once, each on a connection of
    #: its own that stays open for the next; more wait for one, within ``request_timeout_s``. SGLang's scheduler
    #: batches only what reached it, so this should exceed the requests one engine is to run at once (its
    #: ``--max-running-requests``). Each is a file descriptor of the rollout process (``ulimit -n``)
    max_connections: int = 4096

    def check(self) -> None:
        """Timeouts are positive seconds, ``max_connections`` a positive count (the pause mode is one of SGLang's:
        the base checks it)."""
        super().check()
        self.require_seconds("request_timeout_s", "control_timeout_s", "update_timeout_s")
        self.require_positive_int("max_connections")


@dataclass
class LoraServerFlags(Options):
    """SGLang 0.5.23's server flags for serving LoRA adapters (sglang/srt/arg_groups/fields/lora.py), with the
    rules its ``check_lora_server_args`` (arg_groups/lora_hook.py) applies at launch, checked here first.

    Adapters are loaded at run time (``/load_lora_adapter``), never from ``--lora-paths``, so SGLang needs the
    rank and the target modules up front: it sizes its adapter memory pool by them, and refuses an adapter of a
    higher rank or with other modules.
    """

    KEY = "sglang_launch"

    #: ``--enable-lora``: serve LoRA adapters (the LoRA endpoints and ``lora_path`` on ``/generate``)
    enable_lora: bool = False
    #: ``--max-lora-rank``: the highest adapter rank the server takes (needed with ``enable_lora``)
    max_lora_rank: int | None = None
    #: ``--lora-target-modules``: the modules adapters may adapt, SGLang's names (Hugging Face projections such as
    #: ``q_proj``, or ``all`` alone); needed with ``enable_lora``
    lora_target_modules: tuple[str, ...] | None = None
    #: ``--max-loras-per-batch``: adapters one running batch may mix, the base counting as one
    max_loras_per_batch: int = 8
    #: ``--max-loaded-loras``: adapters loaded at once (None: no limit); at the limit SGLang unloads the least
    #: recently used unpinned adapter to load another. Must be >= ``max_loras_per_batch``
    max_loaded_loras: int | None = None

    def check(self) -> None:
        """SGLang's launch rules for the LoRA flags (lora_hook.py ``check_lora_server_args``)."""
        super().check()
        self.require_positive_int("max_loras_per_batch")
        if self.lora_target_modules is not None:
            self.lora_target_modules = tuple(self.lora_target_modules)
        if not self.enable_lora:
            for name in ("max_lora_rank", "lora_target_modules", "max_loaded_loras"):
                self.require(getattr(self, name) is None, name,
                             "is an SGLang LoRA flag; set enable_lora too (SGLang ignores it without --enable-lora)")
            return
        self.require(self.max_lora_rank is not None and self.lora_target_modules,
                     "max_lora_rank" if self.max_lora_rank is None else "lora_target_modules",
                     "is needed with enable_lora: adapters load at run time, so SGLang sizes its adapter pool by "
                     "--max-lora-rank and --lora-target-modules")
        self.require_positive_int("max_lora_rank")
        unknown = [m for m in self.lora_target_modules or () if m not in SGLANG_LORA_TARGETS]
        self.require(not unknown, "lora_target_modules",
                     f"names {unknown}: SGLang takes {', '.join(SGLANG_LORA_TARGETS)} (PEFT's all-linear is "
                     f"{', '.join(ALL_LINEAR_TARGETS)})")
        self.require("all" not in self.lora_target_modules or len(self.lora_target_modules) == 1,
                     "lora_target_modules", "gives 'all' with other names; SGLang takes 'all' alone")
        if self.max_loaded_loras is not None:
            self.require_positive_int("max_loaded_loras")
            self.require(self.max_loaded_loras >= self.max_loras_per_batch, "max_loaded_loras",
                         f"must be >= max_loras_per_batch={self.max_loras_per_batch} (SGLang's rule)")

    def lora_args(self) -> list[str]:
        """The LoRA flags on SGLang's command line (none without ``enable_lora``)."""
        if not self.enable_lora:
            return []
        out = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
               "--lora-target-modules", *(self.lora_target_modules or ()),
               "--max-loras-per-batch", str(self.max_loras_per_batch)]
        if self.max_loaded_loras is not None:
            out += ["--max-loaded-loras", str(self.max_loaded_loras)]
        return out

    def with_lora(self, rank: int, target_modules: Sequence[str], live_versions: int):
        """These options with the LoRA flags of a run whose ``live_versions`` weight versions are adapters of rank
        ``rank`` on ``target_modules`` (Hugging Face projection names, or ``all-linear``).

        ``live_versions + 1`` adapters must fit, since the next version loads before the oldest unloads, and a
        batch may mix all of them and the base: ``max_loras_per_batch = max_loaded_loras = live_versions + 2``.
        """
        if isinstance(live_versions, bool) or not isinstance(live_versions, int) or live_versions < 1:
            raise ValueError(f"live_versions={live_versions!r} must be an int >= 1 (rollout.max_versions)")
        targets = list(target_modules)
        if "all-linear" in targets:
            targets = [t for t in targets if t != "all-linear"] + [t for t in ALL_LINEAR_TARGETS if t not in targets]
        slots = live_versions + 2
        return dataclasses.replace(self, enable_lora=True, max_lora_rank=int(rank), lora_target_modules=tuple(targets),
                                   max_loras_per_batch=slots, max_loaded_loras=slots)


@dataclass
class SGLangLaunchOptions(LoraServerFlags):
    """How :meth:`~rollout_sglang.engines.sglang_client.SGLangEngine.launch` starts an SGLang server process (with
    the LoRA flags of :class:`LoraServerFlags`)."""

    KEY = "sglang_launch"

    #: the address the server binds (``0.0.0.0``: every interface; the client then calls it on loopback)
    host: str = "127.0.0.1"
    #: the port the server binds (None or 0: a free one)
    port: int | None = None
    #: SGLang's ``--dtype``
    dtype: str = "auto"
    #: more SGLang flags, without dashes, to values (``{mem_fraction_static: 0.8, context_length: 32768}``):
    #: checked against the pinned SGLang's own flags (:mod:`~rollout_sglang.engines.sglang_server_args`)
    server_args: dict[str, Any] = field(default_factory=dict)
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
        """A port in range, a positive startup limit, server flags that the pinned SGLang takes, the LoRA flags'
        rules."""
        super().check()
        if self.port is not None:
            self.require_int("port", 0, 65535, why="None or 0 picks a free port")
        self.require_seconds("startup_timeout_s")
        try:
            server_args_argv(self.server_args, f"{self.KEY}.server_args")
        except ValueError as e:
            raise OptionError(str(e)) from None
