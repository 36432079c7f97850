"""The ``lora:`` section: low-rank adapters trained instead of the whole model.

Target modules are named as Hugging Face names the projections. Megatron holds q, k and v as one fused linear
layer, and gate and up as another, so each fused group is adapted as a whole: one ``A`` shared by its parts and
one ``B`` over the fused output. That is exactly a PEFT adapter whose parts share ``A``, which is how it is
exported.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from env_controller.options import Options

#: Hugging Face projection names by the megatron linear layer that holds them
MODULE_PARTS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
ALL_LINEAR = "all-linear"
TARGETS: tuple[str, ...] = tuple(p for parts in MODULE_PARTS.values() for p in parts)


@dataclass
class LoraOptions(Options):
    """Low-rank adapters on the transformer's linear layers; the base model is frozen (docs/training.md, LoRA)."""

    KEY: ClassVar[str] = "lora"

    #: the adapters' rank; 0: no adapters, every parameter is trained
    rank: int = 0
    #: the adapters' output is scaled by ``alpha / rank``
    alpha: float = 16.0
    #: dropout on the adapters' input while training
    dropout: float = 0.0
    #: Hugging Face projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or
    #: ``all-linear``; q/k/v and gate/up are fused in megatron: name all of a group or none of it
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    #: how ``A`` starts (``B`` starts at 0, so the adapted model starts as the base): ``kaiming`` (uniform, as
    #: PEFT's default) or ``gaussian`` (std 1 / rank)
    init: Literal["kaiming", "gaussian"] = "kaiming"
    #: SGLang servers (``rollout.engine_urls``) read each weight version's adapter from a directory under this one,
    #: which they must be able to read (a shared filesystem on a cluster); empty: ``<output_dir>/adapters``
    adapter_dir: str = ""

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_int("rank", low=0, why="0: no adapters")
        self.require_above_zero("alpha")
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        self.require(isinstance(self.target_modules, list) and bool(self.target_modules), "target_modules",
                     f"must be a non-empty list of {', '.join(TARGETS)} or [{ALL_LINEAR}]")
        unknown = [t for t in self.target_modules if t not in (*TARGETS, ALL_LINEAR)]
        self.require(not unknown, "target_modules", f"names {unknown}: choose from {', '.join(TARGETS)} or "
                     f"{ALL_LINEAR}")
        wanted = set(self.target_modules)
        for parts in MODULE_PARTS.values():
            some = wanted & set(parts)
            self.require(ALL_LINEAR in wanted or not some or some == set(parts), "target_modules",
                         f"names {sorted(some)} without {sorted(set(parts) - some)}: megatron holds "
                         f"{'/'.join(parts)} as one layer; name all of them or none")

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> LoraOptions:
        """The options a checkpoint's ``meta.json`` recorded (``lora``); keys this version does not know are left
        out."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (a rank above 0)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """The factor of the adapters' output, ``alpha / rank``."""
        return self.alpha / self.rank

    def megatron_modules(self) -> list[str]:
        """The megatron layer suffixes adapted (``self_attention.linear_qkv``, ...), in layer order."""
        wanted = set(self.target_modules)
        return [m for m, parts in MODULE_PARTS.items() if ALL_LINEAR in wanted or set(parts) <= wanted]
