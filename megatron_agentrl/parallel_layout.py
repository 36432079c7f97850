"""The trainer's parallel layout (TP x PP x CP x EP) and every rule of what it must divide, checked here once.

Megatron splits attention heads, KV heads and the dense FFN widths over the TP ranks, the layers over the
PP stages, each sequence over the CP ranks (``2 * cp`` chunks of megatron's load-balanced layout) and the
experts of a MoE layer over the EP ranks (experts are not split by TP); the vocabulary is padded to a
multiple of ``make_vocab_size_divisible_by * tp``; a world of processes is a multiple of the layout's
smallest one. The config (``parallel:``, :class:`~megatron_agentrl.config.ParallelConfig` derives from
:class:`ParallelLayout`), the planner (``launch/plan.py``), the conversion (``convert/``), the model build
and MoE settings (``megatron/model.py``, ``megatron/moe.py``) and the process groups
(``megatron/parallel.py``) all ask :class:`ParallelLayout`. Its messages name the key (``parallel.tp`` in
the config, ``tp`` for the converters' ``--tp``), the value and a value that fits.

No torch here: the config and the planner use it on a laptop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from env_controller.options import OptionError, Options


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a model that a layout splits (:meth:`of` a family mapping or of the planner's model shape)."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    #: FFN width of the dense layers' MLP, split over TP (0: every layer is a MoE layer)
    dense_ffn: int = 0
    #: FFN width of each MoE layer's shared expert, split over TP (0: none)
    shared_expert_ffn: int = 0
    #: routed experts of each MoE layer, split over EP (0: a dense model)
    num_experts: int = 0

    @classmethod
    def of(cls, model: Any) -> ModelDims:
        """The dims of a model description that names its sizes as a family mapping does (``model_type``,
        ``num_layers``, ``num_heads``, ``num_kv_heads``, ``intermediate_size``, ``shared_expert_size``,
        ``num_experts``, ``moe_layers``, ``is_moe``): a ``convert`` mapping, or the planner's ``ModelShape``."""
        moe = bool(model.is_moe)
        return cls(model_type=str(model.model_type), num_layers=int(model.num_layers), num_heads=int(model.num_heads),
                   num_kv_heads=int(model.num_kv_heads),
                   dense_ffn=0 if moe and all(model.moe_layers) else int(model.intermediate_size),
                   shared_expert_ffn=int(model.shared_expert_size) if moe else 0,
                   num_experts=int(model.num_experts) if moe else 0)

    def tp_widths(self) -> list[tuple[str, int]]:
        """``(name, size)`` of every width that TP splits."""
        widths = [("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)]
        if self.dense_ffn:
            widths.append(("intermediate_size", self.dense_ffn))
        if self.shared_expert_ffn:
            widths.append(("shared expert width", self.shared_expert_ffn))
        return widths


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sequence_multiple(cp: int) -> int:
    """The multiple every sequence's length is padded to under context parallelism of size ``cp``: ``2 * cp``
    (megatron's load-balanced layout cuts each sequence into ``2 * cp`` chunks), 1 without it."""
    return 2 * cp if cp > 1 else 1


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= vocab_size
    (each TP rank holds an equal shard of the vocab-parallel embedding and output layer)."""
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class ParallelLayout(Options):
    """Megatron model parallelism; the data-parallel size is the world size / (tp * pp * cp).

    tp: tensor-parallel size; pp: pipeline-parallel size (stages).
    cp: context-parallel size: each sequence is split over ``cp`` ranks (megatron's load-balanced
        layout of ``2 * cp`` chunks; the trainer pads every sequence to a multiple of ``2 * cp``).
    ep: expert-parallel size (mixture-of-experts models): the experts of each MoE layer are split
        over ``ep`` ranks of a pipeline stage (tokens travel to their experts by all-to-all); experts
        are not split by TP. ``ep`` must divide the expert count and the ranks of a stage.
    """

    KEY: ClassVar[str] = ""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_positive_int("tp", "pp", "cp", "ep")

    def key(self, name: str) -> str:
        """The dotted key of field ``name`` (``parallel.tp`` in the config, ``tp`` standalone)."""
        return f"{self.KEY}.{name}" if self.KEY else name

    @property
    def model_parallel_size(self) -> int:
        """The smallest world this layout runs on (every world is a multiple of it):
        ``tp * pp * cp``, or ``lcm(tp * cp, ep) * pp`` with expert parallelism."""
        return math.lcm(self.tp * self.cp, self.ep) * self.pp

    def describe_ranks(self) -> str:
        """``parallel.tp * parallel.pp * parallel.cp = 1 * 2 * 2 = 4`` (for messages; ``ep`` when > 1)."""
        tp, pp, cp, ep = (self.key(n) for n in ("tp", "pp", "cp", "ep"))
        if self.ep > 1:
            return (f"lcm({tp} * {cp}, {ep}) * {pp} = "
                    f"lcm({self.tp} * {self.cp}, {self.ep}) * {self.pp} = {self.model_parallel_size}")
        return f"{tp} * {pp} * {cp} = {self.tp} * {self.pp} * {self.cp} = {self.model_parallel_size}"

    def check_world(self, world: int, source: str, fix: str = "") -> None:
        """Refuse a number of trainer processes that the layout's smallest world (:attr:`model_parallel_size`)
        does not divide: then a stage's ranks split neither into TP x CP groups nor into EP groups.

        ``source`` names where the number came from (``--nproc 3``, ``ray.train_workers``); ``fix`` replaces
        the default advice (launch a multiple of that many processes).
        """
        ranks = self.model_parallel_size
        if world >= 1 and world % ranks == 0:
            return
        names = " / ".join(self.key(n) for n in ("tp", "pp", "cp", "ep"))
        raise OptionError(f"{source} = {world} trainer processes is not a multiple of {self.describe_ranks()} (the "
                          "data-parallel size, which train.use_distributed_optimizer shards over, is their quotient); "
                          + (fix or f"launch a multiple of {ranks} processes or change {names}"))

    @property
    def sequence_multiple(self) -> int:
        """The multiple every sequence's length is padded to (:func:`sequence_multiple`)."""
        return sequence_multiple(self.cp)

    def stage_layers(self, num_layers: int) -> int:
        """The layers of each pipeline stage; :class:`FieldError` unless ``pp`` divides ``num_layers``."""
        self.require(num_layers % self.pp == 0, "pp", f"does not divide num_hidden_layers={num_layers}; choose pp "
                     f"in {_divisors(num_layers)}")
        return num_layers // self.pp

    def check_tp(self, dims: ModelDims) -> None:
        """TP divides the heads, the KV heads and the FFN widths it splits."""
        widths = dims.tp_widths()
        bad = [f"{name}={n}" for name, n in widths if n % self.tp]
        fits = [t for t in _divisors(dims.num_kv_heads) if all(n % t == 0 for _, n in widths)]
        self.require(not bad, "tp", f"does not divide {', '.join(bad)} (megatron splits each over the TP ranks); "
                     f"choose tp in {fits}")

    def check_experts(self, model_type: str, num_experts: int) -> None:
        """EP is 1 for a dense model (``num_experts`` 0) and divides a MoE model's experts."""
        if not num_experts:
            self.require(self.ep == 1, "ep", f"needs a mixture-of-experts model; model_type={model_type!r} has no "
                         f"MoE layer: set {self.key('ep')}=1")
            return
        self.require(num_experts % self.ep == 0, "ep", f"does not divide the model's {num_experts} experts; choose ep "
                     f"in {_divisors(num_experts)}")

    def check_model(self, dims: ModelDims) -> None:
        """Every rule between the layout and a model: :meth:`check_tp`, :meth:`stage_layers`, :meth:`check_experts`."""
        self.check_tp(dims)
        self.stage_layers(dims.num_layers)
        self.check_experts(dims.model_type, dims.num_experts)


def uses_sequence_parallel(tp: int, moe: bool, lora: bool) -> bool:
    """Whether the trainer runs sequence parallelism: under TP, as megatron's recipes do (each TP rank keeps 1/tp of
    the tokens in its norms, dropouts and residuals; MoE layers need it). A dense LoRA run keeps it off: the adapters
    take the whole sequence (a MoE LoRA run at TP > 1 is refused)."""
    return tp > 1 and (moe or not lora)
