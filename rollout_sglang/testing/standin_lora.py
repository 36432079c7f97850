"""The stand-in's LoRA serving, as SGLang 0.5.23's LoRA manager does it: names, shapes, TP slicing and errors.

The adapter registry follows the tokenizer manager (``managers/tokenizer_control_mixin.py`` ``load_lora_adapter``,
``_unload_lora_adapter_locked``; ``managers/tokenizer_manager.py`` ``_validate_and_resolve_lora``) and
``lora/lora_registry.py`` (an LRU order of names; an adapter that was ever loaded stays known by name, and a request
that names it after an eviction or an unload loads it again from its path). Loading follows
``lora/lora_manager.py`` ``validate_new_adapter`` and ``lora/mem_pool.py`` ``can_support``; the adapter's tensors
are normalized as ``lora/lora.py`` does (q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``) and sliced
for each TP rank as ``lora/layers.py`` does, each slice checked against the shape of SGLang's adapter buffer
(``lora/mem_pool.py`` ``get_lora_A_shape``/``get_lora_B_shape``). Generation runs the whole adapter on the local
engine: the ranks' slices are disjoint blocks of it. The error texts are SGLang's.

Differences: a slice that does not fit its buffer is refused at load here; SGLang finds it when the adapter first
enters a batch (an assertion in its scheduler). SGLang scales every adapter by ``lora_alpha / r`` (``lora/lora.py``,
``LoRAAdapter.__init__``), also one trained with rsLoRA; the stand-in does the same.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.sglang_options import LoraServerFlags

logger = logging.getLogger(__name__)

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
#: PEFT's module names -> SGLang's stacked modules (``get_normalized_target_modules``, lora/utils.py), the part of
#: the mapping that concerns a dense decoder
_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj", "embed_tokens": "embed_tokens", "lm_head": "lm_head"}
#: modules whose input dimension TP splits (lora/utils.py ``ROW_PARALLELISM_LINEAR_LORA_NAMES``)
_ROW_PARALLEL = ("o_proj", "down_proj")
#: how many projections a stacked module holds (lora/utils.py ``get_stacked_multiply``)
_STACK = {"qkv_proj": 3, "gate_up_proj": 2}


class LoraRefused(ValueError):
    """SGLang refuses the LoRA request; the message is its own."""


def normalized_targets(target_modules: Any) -> set[str]:
    """SGLang's module names for PEFT's ``target_modules`` (lora/utils.py ``get_normalized_target_modules``)."""
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise LoraRefused("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {_STACKED.get(name.split(".")[-1], name.split(".")[-1]) for name in target_modules}


def target_module_name(full_name: str, targets: set[str]) -> str:
    """The target module a weight belongs to: the longest target contained in its name (lora/utils.py
    ``get_target_module_name``)."""
    best = None
    for t in targets:
        if t in full_name and (best is None or len(t) > len(best)):
            best = t
    if best is None:
        raise LoraRefused(f"Cannot find target module name for {full_name} in {targets}")
    return best


def normalize_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter's PEFT-named tensors as SGLang holds them: ``q/k/v_proj`` stacked into ``qkv_proj`` (a missing k as
    zeros) and ``gate/up_proj`` into ``gate_up_proj`` (a missing up as zeros), along dim 0 for A and B alike
    (lora/lora.py ``normalize_qkv_proj``, ``normalize_gate_up_proj``; dense layers). LoraRefused for q without v,
    which SGLang's loader fails on (a KeyError naming the v tensor)."""
    w = dict(weights)
    names = list(w)
    present = {p for p in ("q_proj", "k_proj", "v_proj", "qkv_proj") if any(p in n for n in names)}
    if present:
        for name in names:
            if "q_proj" in name:
                k, v, qkv = (name.replace("q_proj", p) for p in ("k_proj", "v_proj", "qkv_proj"))
                if v not in w:
                    raise LoraRefused(f"{v!r} (SGLang stacks q_proj, k_proj and v_proj into qkv_proj and needs "
                                      f"{v} beside {name})")
                kw = w[k] if "k_proj" in present else torch.zeros_like(w[v])
                w[qkv] = torch.cat((w[name], kw, w[v]), 0)
                w.pop(name)
                if "k_proj" in present:
                    w.pop(k)
                w.pop(v)
            elif "qkv_proj" in name and "lora_A" in name:
                w[name] = w[name].repeat(3, 1)
    for name in list(w):
        if "gate_proj" in name:
            up, gate_up = name.replace("gate_proj", "up_proj"), name.replace("gate_proj", "gate_up_proj")
            if up not in w or w[up].numel() == 0:
                w[up] = torch.zeros_like(w[name])
            w[gate_up] = torch.cat((w[name], w[up]), w[name].dim() - 2)
            w.pop(name)
            w.pop(up)
        elif "gate_up_proj" in name and "lora_A" in name:
            w[name] = w[name].repeat(2, 1)
    return w


def _divide(n: int, d: int) -> int:
    """SGLang's ``divide`` (distributed/utils.py): its assertion message when ``d`` does not divide ``n``."""
    if n % d:
        raise LoraRefused(f"{n} is not divisible by {d}")
    return n // d


@dataclass(frozen=True)
class Geometry:
    """The sizes of a dense decoder's projections that SGLang's parallel linear layers shard (layers/linear.py).

    hidden, heads, kv_heads, head_dim, inter: the model config's; tp: the server's TP size.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    tp: int

    @classmethod
    def of(cls, config: Any, tp: int) -> "Geometry":
        """From a Hugging Face config."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(config.hidden_size), heads, int(getattr(config, "num_key_value_heads", None) or heads),
                   int(head_dim), int(config.intermediate_size), int(tp))

    def kv_split(self) -> tuple[int, int]:
        """(KV heads per rank, ranks per KV head) as ``QKVParallelLinear`` splits them (linear.py: a KV head is
        replicated when TP exceeds the KV heads)."""
        if self.tp >= self.kv_heads:
            return 1, _divide(self.tp, self.kv_heads)
        return _divide(self.kv_heads, self.tp), 1

    def dims(self, module: str) -> tuple[int, int]:
        """(input, output) of ``module`` unsharded (lora/utils.py ``get_default_hidden_dim``)."""
        h, d = self.hidden, self.head_dim
        return {"qkv_proj": (h, d * (self.heads + 2 * self.kv_heads)), "o_proj": (d * self.heads, h),
                "gate_up_proj": (h, 2 * self.inter), "down_proj": (self.inter, h)}[module]

    def buffer_shapes(self, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of one rank's A and B of an adapter of rank ``rank`` (lora/mem_pool.py ``get_lora_A_shape``,
        ``get_lora_B_shape``, ``_column_parallel_lora_b_per_rank_dim``; the adapter fills ``[:r * stack]`` of A's
        rows and ``[:, :r]`` of B)."""
        din, dout = self.dims(module)
        if module in _ROW_PARALLEL:
            return (rank, _divide(din, self.tp)), (dout, rank)
        if module == "qkv_proj" and self.kv_heads < self.tp:
            out = _divide(self.heads * self.head_dim, self.tp) + 2 * self.head_dim
        else:
            out = _divide(dout, self.tp)
        return (rank * _STACK.get(module, 1), din), (out, rank)

    def slice(self, module: str, a: torch.Tensor, b: torch.Tensor, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``tp_rank``'s A and B of a normalized module (lora/layers.py ``slice_lora_a_weights``,
        ``slice_lora_b_weights`` of ``QKVParallelLinearWithLoRA``, ``MergedColumnParallelLinearWithLoRA`` and
        ``RowParallelLinearWithLoRA``)."""
        if module in _ROW_PARALLEL:
            shard = _divide(self.dims(module)[0], self.tp)
            return a[:, tp_rank * shard:(tp_rank + 1) * shard].contiguous(), b
        if module == "gate_up_proj":
            part = _divide(self.inter, self.tp)
            s = tp_rank * part
            return a, torch.cat([b[s:s + part], b[self.inter + s:self.inter + s + part]], 0)
        if module == "qkv_proj":
            q_shard = _divide(self.heads, self.tp) * self.head_dim
            kv_per_rank, replicas = self.kv_split()
            kv_shard = kv_per_rank * self.head_dim
            kv_start = kv_shard * (tp_rank // replicas)
            q_size, k_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return a, torch.cat([b[q_shard * tp_rank:q_shard * (tp_rank + 1)],
                                 b[q_size + kv_start:q_size + kv_start + kv_shard],
                                 b[q_size + k_size + kv_start:q_size + k_size + kv_start + kv_shard]], 0)
        raise LoraRefused(f"the stand-in slices qkv_proj, o_proj, gate_up_proj and down_proj for TP; {module} at "
                          f"--tp-size {self.tp} is not modelled (run it at --tp-size 1)")


def check_slices(adapter: Adapter, targets: set[str], geometry: Geometry) -> None:
    """Normalize ``adapter`` and slice it for every TP rank as SGLang does; LoraRefused with SGLang's message for a
    weight outside ``targets`` or a slice that does not fit SGLang's buffer."""
    if geometry.tp > 1:  # SGLang's attention layer divides the heads first (linear.py QKVParallelLinear): at launch
        _divide(geometry.heads, geometry.tp)
        geometry.kv_split()
    weights = normalize_weights(adapter.tensors)
    layer = re.compile(r"layers\.(\d+)\.")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str] = {}
    for name, t in weights.items():
        if layer.search(name) is None and not ("embed_tokens" in name or "lm_head" in name):
            continue  # SGLang keeps only per-layer weights and embeddings
        prefix = name.rsplit(".lora_", 1)[0]
        kinds[prefix] = target_module_name(name, targets)
        modules.setdefault(prefix, {})["A" if ".lora_A." in name else "B"] = t
    for prefix, parts in modules.items():
        kind = kinds[prefix]
        if kind not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if geometry.tp > 1:
                geometry.slice(kind, parts["A"], parts["B"], 0)  # refuses, naming the module
            continue
        for tp_rank in range(geometry.tp):
            a, b = geometry.slice(kind, parts["A"], parts["B"], tp_rank)
            want_a, want_b = geometry.buffer_shapes(kind, adapter.rank)
            for want, got in ((want_a, a), (want_b, b)):
                if tuple(got.shape) != want:
                    raise LoraRefused(f"LoRA buffer shape {torch.Size(want)} does not match weight shape "
                                      f"{got.shape}. ({prefix}, TP rank {tp_rank})")


@dataclass
class _Ref:
    """A loaded adapter: its SGLang name and path, whether pinned, and its name on the local engine."""

    name: str
    path: str
    pinned: bool
    engine_name: str


class LoraServing:
    """The adapters a stand-in serves, under SGLang's rules (see the module doc). Not thread-safe: the stand-in
    calls it under one lock, from worker threads (loading reads files and waits for the engine's lock)."""

    def __init__(self, engine: Any, flags: LoraServerFlags, tp_size: int) -> None:
        self.engine = engine
        self.flags = flags
        self.enabled = bool(flags.enable_lora)
        self.targets = normalized_targets(flags.lora_target_modules or ()) if self.enabled else set()
        if self.targets == {"all"}:  # SGLang resolves 'all' from the model's linear layers and embeddings
            self.targets = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"}
        self.geometry = Geometry.of(engine.model.config, tp_size)
        self.registry: OrderedDict[str, _Ref] = OrderedDict()  # by name, least recently used first
        self.known: dict[str, _Ref] = {}  # every adapter ever loaded, by name (SGLang's lora_ref_cache)
        self.in_use: dict[str, int] = {}
        self._serial = 0

    def loaded(self) -> dict[str, str]:
        """``{name: path}`` of the loaded adapters (SGLang's ``loaded_adapters``)."""
        return {r.name: r.path for r in self.registry.values()}

    def load(self, name: str, path: str, pinned: bool = False) -> None:
        """Load the PEFT adapter at ``path`` as ``name``; LoraRefused with SGLang's message when it refuses. At
        ``--max-loaded-loras`` the least recently used unpinned adapter is unloaded, as SGLang does."""
        if not self.enabled:
            raise LoraRefused(NOT_ENABLED)
        try:
            adapter = Adapter.load(path, self._serial)
        except ValueError as e:
            raise LoraRefused(str(e)) from None
        cfg = adapter.config
        if cfg.get("use_dora"):
            raise LoraRefused(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        if name in self.registry:
            raise LoraRefused(f"Failed to load LoRA adapter {name} because it is already loaded")
        targets = normalized_targets(cfg.get("target_modules") or [])
        if adapter.rank > int(self.flags.max_lora_rank or 0) or not ("all" in targets or targets <= self.targets):
            raise LoraRefused(
                f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                "and that the target modules are included in `--lora-target-modules`.")
        pinned_now = sum(r.pinned for r in self.registry.values())
        if pinned and pinned_now >= self.flags.max_loras_per_batch - 1:
            raise LoraRefused(
                f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots in the "
                "LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "
                "`--max-loras-per-batch` or load it as unpinned LoRA adapters.")
        check_slices(adapter, self.targets, self.geometry)
        if cfg.get("use_rslora"):  # SGLang scales by lora_alpha / r whatever the adapter was trained with
            adapter.config = {**cfg, "use_rslora": False}
        try:
            self.engine.load_adapter(adapter)
        except ValueError as e:
            raise LoraRefused(str(e)) from None
        self._serial += 1
        ref = _Ref(name, str(path), bool(pinned), adapter.name)
        self.registry[name] = self.known[name] = ref
        limit = self.flags.max_loaded_loras
        while limit is not None and len(self.registry) > limit:
            lru = next((n for n, r in self.registry.items() if not r.pinned), None)
            if lru is None:
                raise LoraRefused("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                                  f"LoRA registry is: {self.registry}")
            logger.info("Unloading least recently used LoRA adapter '%s' (current number of adapters: %d, max "
                        "allowed: %d)", lru, len(self.registry), limit)
            self.unload(lru)

    def unload(self, name: str) -> None:
        """Unload ``name`` (the caller waited for the requests that use it); LoraRefused with SGLang's message."""
        if not self.enabled:
            raise LoraRefused(NOT_ENABLED)
        ref = self.registry.get(name)
        if ref is None:
            raise LoraRefused(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}")
        del self.registry[name]
        self.engine.unload_adapter(ref.engine_name)

    def resolve(self, lora_path: Any, rows: int) -> list[str | None] | None:
        """The local engine's adapter per row for a ``/generate`` ``lora_path`` (one name for all rows, or one per
        row, None: the base), loading again an adapter that was evicted or unloaded; None when the request names
        none. LoraRefused with SGLang's message (LoRA off, too many adapters, one never loaded)."""
        if not lora_path:
            return None
        if not self.enabled:
            first = lora_path if isinstance(lora_path, str) else next((a for a in lora_path if a), None)
            raise LoraRefused(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the "
                              "server with --enable-lora flag and preload adapters using --lora-paths or "
                              "/load_lora_adapter endpoint.")
        names = [lora_path] * rows if isinstance(lora_path, str) else list(lora_path)
        if len(names) != rows:  # SGLang indexes lora_path by row (io_struct.py); the stand-in refuses a mismatch
            raise LoraRefused(f"lora_path has {len(names)} entries for {rows} prompts; give one per prompt")
        unique = set(names)
        limit = self.flags.max_loaded_loras
        if limit is not None and len(unique) > limit:
            raise LoraRefused(f"Received request with {len(unique)} unique loras requested but max loaded loras is "
                              f"{limit}")
        for name in unique:
            if name is None:
                continue
            if name in self.registry:
                self.registry.move_to_end(name)
                continue
            if name not in self.known:
                raise LoraRefused(f"Got LoRA adapter that has never been loaded: {name}\n"
                                  f"All loaded adapters: {self.known.keys()}.")
            logger.info("Reloading evicted adapter: %s", name)
            ref = self.known[name]
            try:
                self.load(ref.name, ref.path, ref.pinned)
            except LoraRefused as e:
                raise LoraRefused(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
        for name in names:
            if name is not None:
                self.registry.move_to_end(name)
        return [self.registry[n].engine_name if n is not None else None for n in names]
