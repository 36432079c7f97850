"""The settings of the SGLang stand-in (:class:`~rollout_sglang.testing.sglang_standin.StandInServer`): where it
listens and the SGLang server flags it mirrors, declared and checked once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_sglang.engines.sglang_options import LoraServerFlags


@dataclass
class StandInOptions(LoraServerFlags):
    """How a stand-in serves its engine; the SGLang flag each field mirrors is named where it has one (the LoRA
    flags: :class:`~rollout_sglang.engines.sglang_options.LoraServerFlags`, checked by SGLang's rules)."""

    KEY = "standin"

    #: the address to listen on (``--host``)
    host: str = "127.0.0.1"
    #: the port to listen on (``--port``; 0: a free one, ``url`` after ``start``)
    port: int = 0
    #: what ``/model_info`` reports (``--model-path``)
    model_path: str = "standin"
    #: limit on joining a weight-sync group and on each receive, seconds
    group_timeout_s: float = 300.0
    #: weight-sync ranks the server joins with (``--tp-size``; SGLang: one per TP rank, at ``rank_offset +
    #: tp_rank``); every rank receives every broadcast, and rank 0's copy is loaded after the others were checked
    #: equal to it
    tp_size: int = 1
    #: join a weight-sync group's collectives only at the first update request, as SGLang does on NCCL (what
    #: production sees); False joins inside ``/init_weights_update_group``, as SGLang does on gloo
    lazy_join: bool = True
    #: ``--enable-deterministic-inference``: a row without ``sampling_seed`` samples with seed 42, so equal
    #: prompts give equal samples
    deterministic: bool = False
    #: ``--api-key`` (SGLang's auth rules per endpoint)
    api_key: str | None = field(default=None, repr=False)
    #: ``--admin-api-key``: with it, the ``ADMIN_OPTIONAL`` endpoints take only this key
    admin_api_key: str | None = field(default=None, repr=False)
    #: ``--weight-version``: the version reported until an update sets one (None: SGLang's ``"default"``)
    weight_version: str | None = None
    #: ``--enable-return-routed-experts``: requests that ask for routed experts get them (MoE models only:
    #: SGLang's capturer sizes its buffers by the config's ``num_experts_per_tok``)
    capture_routing: bool = False
    #: limit on an adapter's unload waiting for the requests that use it, seconds (SGLang waits for them too)
    unload_wait_s: float = 60.0
    #: test hook, for a server in a process of its own (``--test-sigkill-on-pause N``; 0: off): the process
    #: SIGKILLs itself right after answering the Nth ``/pause_generation`` that finds requests running, which it
    #: then holds: an engine that dies while paused for an in-flight update
    sigkill_on_pause: int = 0
    #: test hook (``--test-hold-update N``; 0: off): the Nth ``/begin_weight_update`` opens its session, then
    #: answers only ``hold_update_s`` seconds later: an update held open (the server paused, no
    #: ``/continue_generation`` yet), for a test to kill the trainer meanwhile
    hold_update: int = 0
    #: how long the held ``/begin_weight_update`` waits before it answers, seconds (``--test-hold-update-s``)
    hold_update_s: float = 10.0
    #: SGLang flags the stand-in takes but does not act on (``--mem-fraction-static 0.8``), by SGLang's field name
    #: to their command-line text; ``/server_info`` reports them, as SGLang reports its server args
    other_server_args: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """A port in range, positive limits and TP size, the LoRA flags' rules."""
        super().check()
        self.require_int("port", 0, 65535, why="0 picks a free port")
        self.require_seconds("group_timeout_s", "unload_wait_s", "hold_update_s")
        self.require_int("sigkill_on_pause", low=0, why="0 = off")
        self.require_int("hold_update", low=0, why="0 = off")
        self.require_positive_int("tp_size")
