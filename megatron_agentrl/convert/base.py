"""Megatron-core <-> Hugging Face weight mapping shared by every GPT family, dense and MoE.

Pure tensor code (no torch.distributed): used by the actor (load / export), the offline
converters (``hf_to_megatron``, ``megatron_to_hf``) and the live weight sync alike. A family
module (``qwen2.py``, ``qwen3.py``, ``llama.py``, ``glm4.py``, ``qwen3_moe.py``, ``glm4_moe.py``)
subclasses :class:`GPTMapping` and declares every fact of its family there: its weight names (class flags),
its megatron ``TransformerConfig`` options (:meth:`GPTMapping.transformer_options`, and
:meth:`GPTMapping.router_options` for a MoE family) and its default chat format; everything else is shared.
The family registry is ``megatron_agentrl.convert`` (``_families``). torch is imported by the methods that
move tensors, so that the registry answers questions about a family (names, options, chat format) without it.

Vocabulary of this module:

* **Megatron name**: a parameter name of a megatron-core ``GPTModel`` built as one TP=1, PP=1
  model, i.e. with *global* layer indices (``decoder.layers.<global i>...``). Both the local
  layer-spec names (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) and the
  TransformerEngine ones (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) are understood. A model chunk of a PP stage names its
  layers locally; the caller renames them to global indices (see ``actor.py``).
* **Full Megatron tensor**: the tensor a TP=1 model holds for that name, without vocab padding.
  QKV is interleaved per query group (``[q heads of group g, k_g, v_g]`` for g = 0..G-1) and
  ``linear_fc1`` is ``[gate; up]``.
* **TP shard**: what TP rank r of tp holds. Column-parallel weights are split on dim 0 (QKV
  splits cleanly by whole query groups), row-parallel on dim 1, ``linear_fc1`` is split
  gate-wise and up-wise so that each rank holds ``[gate_r; up_r]``, and the vocab-parallel
  embedding / output layer are first zero-padded to the padded vocab size
  (a multiple of ``make_vocab_size_divisible_by * tp``) and then split on dim 0. Norms are
  replicated.
* **Experts** (MoE layers): expert ``e`` of layer ``i`` is
  ``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1.weight`` (``[gate; up]``) and
  ``...linear_fc2.weight`` with the *global* expert index (an expert-parallel rank renames its local
  experts, see ``actor.py``); experts are not split over TP (expert tensor parallel size 1). The
  router is ``mlp.router.weight`` (and ``mlp.router.expert_bias``, a buffer, for GLM-4.5), a shared
  expert ``mlp.shared_experts.linear_fc1/fc2.weight`` (split over TP like a dense MLP).
* **Checkpoint key**: the key of megatron-core's distributed checkpoint
  (``GPTModel.sharded_state_dict()``): layer tensors of all layers are one global tensor
  ``[num_layers, *full shape]`` under ``decoder.layers.<TE-style suffix>``, experts
  ``[num_layers, num_experts, *full shape]`` under ``decoder.layers.mlp.experts.experts.linear_fc1.weight``.
  When dense and MoE layers mix (GLM-4.5's first dense layers) megatron keys every layer on its own
  (``decoder.layers.<i>.<suffix>``, experts ``[num_experts, ...]``). The vocab tensors are stored
  padded (``[padded_vocab, hidden]``) and loaded with ``allow_shape_mismatch``, so another padding
  (another TP) still loads.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_agentrl.config import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"

HF_EMBEDDING = "model.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")

# HF keys that may appear in a state dict but are not parameters to load.
_HF_IGNORABLE_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# Per-layer Megatron suffix -> kind (every family).
_LAYER_SUFFIX_KIND = {
    "input_layernorm.weight": "input_norm",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv",
    "self_attention.linear_proj.weight": "proj",
    "pre_mlp_layernorm.weight": "post_attn_norm",
    "mlp.linear_fc1.layer_norm_weight": "post_attn_norm",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "fc2",
}
# Extra per-layer norms of the "sandwich" families (GLM-4): normalise each sublayer's output
# before the residual add.
_POST_NORM_SUFFIX_KIND = {
    "post_self_attn_layernorm.weight": "post_self_attn_norm",
    "post_mlp_layernorm.weight": "post_mlp_norm",
}
# Per-head RMSNorms of the query and key (Qwen3; megatron-core's ``qk_layernorm``).
_QK_NORM_SUFFIX_KIND = {
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
}
# The router and shared expert of a MoE layer (experts are matched by ``_EXPERT_RE``).
_MOE_SUFFIX_KIND = {
    "mlp.router.weight": "router",
    "mlp.router.expert_bias": "expert_bias",
    "mlp.shared_experts.linear_fc1.weight": "shared_fc1",
    "mlp.shared_experts.linear_fc2.weight": "shared_fc2",
}
# Kinds whose Megatron tensor is ``[gate; up]`` of two HF tensors.
_GATED_KINDS = ("fc1", "expert_fc1", "shared_fc1")
# Local layer-spec suffix -> the suffix megatron-core's sharded_state_dict stores it under
# (the local spec's ``sharded_state_dict_keys_map``; TE names are stored as they are).
_CKPT_SUFFIX = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class ConversionError(ConfigError):
    """A checkpoint or conversion request that cannot be honoured; the message names the bad
    value (path, tensor, size) and the fix."""


def one_line(e: BaseException) -> str:
    """``e`` as one line: its type and message, whitespace runs (newlines included) made single spaces."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass(frozen=True)
class TPLayout:
    """How one Megatron parameter is split over tensor-parallel ranks.

    partition_dim: the split dimension, or None when every TP rank holds the full tensor.
    gated: ``linear_fc1`` of a gated MLP (each shard is ``[gate_r; up_r]``).
    vocab: vocab-parallel (embedding / output layer): padded on dim 0 before splitting.
    """

    partition_dim: int | None
    gated: bool = False
    vocab: bool = False


@dataclass(frozen=True)
class CheckpointChunk:
    """One stored piece of a tensor in the distributed checkpoint, as a TP rank would save it.

    offsets / sizes: position and shape of the piece inside the full (padded, for vocab
    tensors) Megatron tensor, without the stacked-layer axis.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class GPTMapping:
    """Name and layout mapping for one dense decoder-only config (RMSNorm, SwiGLU, GQA, rotary).

    Subclasses set the family flags:

    * ``model_type`` / ``architecture``: the transformers ``model_type`` and class name.
    * ``hf_fused_gate_up``: HF stores ``mlp.gate_up_proj.weight`` (``[gate; up]``) instead of
      separate ``gate_proj`` / ``up_proj``.
    * ``post_norms``: each layer also has ``post_self_attn_layernorm`` and
      ``post_mlp_layernorm`` (GLM-4).
    * ``qk_norms``: each layer normalises every head's query and key (``[head_dim]`` RMSNorm
      weights, Qwen3).
    * :meth:`_qkv_bias`: whether q/k/v projections carry a bias (and the refusal of biases megatron's GPT
      layer cannot hold, Llama's ``attention_bias`` / ``mlp_bias``).
    * ``rotary_interleaved``: the rotary embedding rotates pairs ``(2i, 2i+1)`` (GLM-4) instead of the two
      halves of the rotated dims; ``partial_rotary``: the family may rotate only the first
      ``partial_rotary_factor`` of each head's dims (GLM-4, GLM-4.5). With ``qkv_bias`` and ``qk_norms``
      they make :meth:`transformer_options`.
    * ``default_chat_template``: the chat format (a name of ``rollout_sglang.chat_template.CHAT_TEMPLATES``)
      that ``model.chat_template=auto`` picks for the family.
    * MoE families: :meth:`_num_experts`, :meth:`_moe_layers`, :meth:`_shared_expert_size`, the
      ``expert_bias`` flag (the router's score-correction bias, GLM-4.5) and :meth:`router_options`.

    Args:
        hf_config: a transformers config (or any object with ``num_hidden_layers``,
            ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
            ``intermediate_size``, ``vocab_size``, optional ``head_dim`` and
            ``tie_word_embeddings``).

    Raises:
        ConversionError: the config is not one this family can express (e.g. heads not a
            multiple of the KV heads, biases megatron cannot hold).
    """

    model_type: str = ""
    architecture: str = ""
    hf_fused_gate_up: bool = False
    post_norms: bool = False
    qk_norms: bool = False
    expert_bias: bool = False
    rotary_interleaved: bool = False
    partial_rotary: bool = False
    default_chat_template: str = ""

    def __init__(self, hf_config: Any) -> None:
        self.num_layers = int(hf_config.num_hidden_layers)
        self.hidden_size = int(hf_config.hidden_size)
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or self.num_heads)
        head_dim = getattr(hf_config, "head_dim", None)
        self.head_dim = int(head_dim) if head_dim else self.hidden_size // self.num_heads
        self.intermediate_size = int(hf_config.intermediate_size)
        self.vocab_size = int(hf_config.vocab_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.qkv_bias = self._qkv_bias(hf_config)
        if self.num_heads % self.num_kv_heads != 0:
            raise ConversionError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        self.num_experts = self._num_experts(hf_config)
        self.moe_layers = self._moe_layers(hf_config) if self.num_experts else [False] * self.num_layers
        self.moe_intermediate_size = int(hf_config.moe_intermediate_size) if self.num_experts else 0
        self.shared_expert_size = self._shared_expert_size(hf_config) if self.num_experts else 0
        # megatron stacks layers in its checkpoint only when all layers are alike (all dense or all MoE)
        self.stacked_layers = len(set(self.moe_layers)) <= 1
        self._suffix_kind = dict(_LAYER_SUFFIX_KIND)
        if self.post_norms:
            self._suffix_kind.update(_POST_NORM_SUFFIX_KIND)
        if self.qk_norms:
            self._suffix_kind.update(_QK_NORM_SUFFIX_KIND)
        if self.num_experts:
            self._suffix_kind.update(_MOE_SUFFIX_KIND)

    def _qkv_bias(self, hf_config: Any) -> bool:
        """Whether q/k/v carry a bias in this family (subclasses override)."""
        return False

    def _num_experts(self, hf_config: Any) -> int:
        """Routed experts per MoE layer; 0 for a dense family (MoE subclasses override)."""
        return 0

    def _moe_layers(self, hf_config: Any) -> list[bool]:
        """Per layer, whether its MLP is a MoE layer (MoE subclasses override)."""
        return [True] * self.num_layers

    def _shared_expert_size(self, hf_config: Any) -> int:
        """FFN width of the shared expert; 0 for none (subclasses override)."""
        return 0

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture-of-experts layer."""
        return any(self.moe_layers)

    # ------------------------------------------------------------ model config
    def transformer_options(self, rotary_fraction: float = 1.0) -> dict[str, Any]:
        """The megatron ``TransformerConfig`` fields of this family and config: ``add_qkv_bias``, ``qk_layernorm``
        and ``rotary_interleaved`` (the rest of a GPT layer is alike in every family).

        ``rotary_fraction``: the config's ``partial_rotary_factor``; ConfigError unless it is 1 or the family
        allows partial rotary, and in (0, 1].
        """
        if rotary_fraction != 1.0 and not self.partial_rotary:
            from megatron_agentrl.convert import MAPPINGS

            allowed = " and ".join(mt for mt, cls in MAPPINGS.items() if cls.partial_rotary)
            raise ConfigError(f"partial_rotary_factor={rotary_fraction} is only supported for {allowed}")
        if not 0.0 < rotary_fraction <= 1.0:
            raise ConfigError(f"partial_rotary_factor={rotary_fraction} must be in (0, 1]")
        return {"add_qkv_bias": self.qkv_bias, "rotary_interleaved": self.rotary_interleaved,
                "qk_layernorm": self.qk_norms}

    def router_options(self, hf_config: Any) -> dict[str, Any]:
        """The megatron ``TransformerConfig`` router fields of a MoE family (score function, expert bias, groups,
        scaling) for ``hf_config``; the fields every MoE family shares are set by
        ``megatron_agentrl.megatron.moe.moe_options``. ConfigError for a router megatron cannot express."""
        raise NotImplementedError(f"{type(self).__name__} declares no router_options (a MoE family must)")

    # ----------------------------------------------------------------- names
    def megatron_names(self, te_names: bool = False) -> list[str]:
        """All Megatron names of a TP=1, PP=1 model, global layer indices.

        With ``te_names`` the TransformerEngine spelling of the fused layer norms is used.
        When embeddings are tied there is no ``output_layer.weight`` (a PP>1 last stage
        holds one; it maps to the embedding, see :meth:`hf_names`).
        """
        names = [EMBEDDING]
        for i in range(self.num_layers):
            names += self.layer_megatron_names(i, te_names)
        names.append(FINAL_NORM)
        if not self.tie_word_embeddings:
            names.append(OUTPUT_LAYER)
        return names

    def layer_megatron_names(self, layer: int, te_names: bool = False) -> list[str]:
        """The Megatron names of decoder layer ``layer`` (global index), in checkpoint order."""
        p = f"decoder.layers.{layer}."
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"
        names = [p + in_norm, p + "self_attention.linear_qkv.weight"]
        if self.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if self.qk_norms:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        if self.post_norms:
            names.append(p + "post_self_attn_layernorm.weight")
        if self.moe_layers[layer]:
            # TE's MoE layer keeps its own pre-MLP norm (no fused fc1 to hold it)
            names += [p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"]
            if self.expert_bias:
                names.append(p + "mlp.router.expert_bias")
            for e in range(self.num_experts):
                names += [p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                          p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if self.shared_expert_size:
                names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight"]
            return names
        names += [p + mlp_norm, p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if self.post_norms:
            names.append(p + "post_mlp_layernorm.weight")
        return names

    def hf_param_names(self) -> list[str]:
        """All HF parameter names the model needs (``lm_head.weight`` only when untied)."""
        out: list[str] = []
        for n in self.megatron_names():
            out += self.hf_names(n)
        return out

    def is_ignorable_hf_name(self, name: str) -> bool:
        """HF keys that may be present but carry nothing to load (rotary buffers, a tied lm_head)."""
        if _HF_IGNORABLE_RE.search(name):
            return True
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and self.num_layers <= int(m.group(1)) < self.num_layers + self.extra_hf_layers:
            return True
        return self.tie_word_embeddings and name == HF_LM_HEAD

    # HF layers past num_hidden_layers that a checkpoint may carry and that are not loaded
    # (GLM-4.5's multi-token-prediction layer); subclasses set it from their config
    extra_hf_layers: int = 0

    def _split(self, mname: str) -> tuple[int | None, str]:
        if mname in (EMBEDDING, OUTPUT_LAYER, FINAL_NORM):
            return None, mname
        m = _LAYER_RE.match(mname)
        expert = _EXPERT_RE.match(m.group(2)) if m else None
        if not m or (m.group(2) not in self._suffix_kind and expert is None):
            raise KeyError(f"'{mname}' is not a Megatron parameter name of a {self.model_type} GPTModel")
        layer = int(m.group(1))
        if layer >= self.num_layers:
            raise KeyError(f"'{mname}': layer {layer} out of range (num_hidden_layers={self.num_layers})")
        if expert is not None:
            if not self.moe_layers[layer] or int(expert.group(1)) >= self.num_experts:
                raise KeyError(f"'{mname}': layer {layer} has no expert {expert.group(1)} "
                               f"({self.num_experts if self.moe_layers[layer] else 0} experts)")
            return layer, "expert_" + expert.group(2)[len("linear_"):]
        return layer, self._suffix_kind[m.group(2)]

    def expert_index(self, mname: str) -> int | None:
        """The global expert index of an expert's Megatron name, else None."""
        m = _LAYER_RE.match(mname)
        expert = _EXPERT_RE.match(m.group(2)) if m else None
        return int(expert.group(1)) if expert else None

    def hf_names(self, mname: str) -> list[str]:
        """The HF parameter names the Megatron parameter ``mname`` is built from (in order)."""
        layer, kind = self._split(mname)
        if layer is None:
            if kind == EMBEDDING:
                return [HF_EMBEDDING]
            if kind == OUTPUT_LAYER:
                return [HF_EMBEDDING] if self.tie_word_embeddings else [HF_LM_HEAD]
            return [HF_FINAL_NORM]
        p = f"model.layers.{layer}."
        if kind == "input_norm":
            return [p + "input_layernorm.weight"]
        if kind == "post_attn_norm":
            return [p + "post_attention_layernorm.weight"]
        if kind == "post_self_attn_norm":
            return [p + "post_self_attn_layernorm.weight"]
        if kind == "post_mlp_norm":
            return [p + "post_mlp_layernorm.weight"]
        if kind in ("q_norm", "k_norm"):
            return [p + f"self_attn.{kind}.weight"]
        if kind == "qkv":
            suffix = mname.rsplit(".", 1)[1]
            return [p + f"self_attn.{x}_proj.{suffix}" for x in ("q", "k", "v")]
        if kind == "proj":
            return [p + "self_attn.o_proj.weight"]
        if kind == "fc1":
            if self.hf_fused_gate_up:
                return [p + "mlp.gate_up_proj.weight"]
            return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        if kind == "router":
            return [p + "mlp.gate.weight"]
        if kind == "expert_bias":
            return [p + "mlp.gate.e_score_correction_bias"]
        if kind in ("expert_fc1", "expert_fc2"):
            e = self.expert_index(mname)
            if kind == "expert_fc1":
                return [p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"]
            return [p + f"mlp.experts.{e}.down_proj.weight"]
        if kind == "shared_fc1":
            return [p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight"]
        if kind == "shared_fc2":
            return [p + "mlp.shared_experts.down_proj.weight"]
        return [p + "mlp.down_proj.weight"]  # fc2

    def tp_layout(self, mname: str) -> TPLayout:
        """How ``mname`` is split over TP ranks (see :class:`TPLayout`)."""
        layer, kind = self._split(mname)
        if layer is None:
            return TPLayout(0, vocab=True) if kind in (EMBEDDING, OUTPUT_LAYER) else TPLayout(None)
        if kind == "qkv":
            return TPLayout(0)
        if kind in ("fc1", "shared_fc1"):
            return TPLayout(0, gated=True)
        if kind in ("proj", "fc2", "shared_fc2"):
            return TPLayout(1)
        if kind == "expert_fc1":  # not split over TP, but stored as gate and up halves
            return TPLayout(None, gated=True)
        return TPLayout(None)

    # ---------------------------------------------------------------- shapes
    def megatron_shape(self, mname: str) -> tuple[int, ...]:
        """Shape of the full (unpadded) Megatron tensor ``mname``."""
        layer, kind = self._split(mname)
        h, d = self.hidden_size, self.head_dim
        if layer is None:
            return (self.vocab_size, h) if kind in (EMBEDDING, OUTPUT_LAYER) else (h,)
        if kind == "qkv":
            rows = (self.num_heads + 2 * self.num_kv_heads) * d
            return (rows,) if mname.endswith(".bias") else (rows, h)
        if kind == "proj":
            return (h, self.num_heads * d)
        if kind == "fc1":
            return (2 * self.intermediate_size, h)
        if kind == "fc2":
            return (h, self.intermediate_size)
        if kind in ("q_norm", "k_norm"):
            return (d,)
        if kind == "router":
            return (self.num_experts, h)
        if kind == "expert_bias":
            return (self.num_experts,)
        if kind in ("expert_fc1", "shared_fc1"):
            width = self.moe_intermediate_size if kind == "expert_fc1" else self.shared_expert_size
            return (2 * width, h)
        if kind in ("expert_fc2", "shared_fc2"):
            return (h, self.moe_intermediate_size if kind == "expert_fc2" else self.shared_expert_size)
        return (h,)  # norms

    def keeps_fp32(self, mname: str) -> bool:
        """Tensors stored in fp32 whatever the model's dtype (the router's expert bias)."""
        return self._split(mname)[1] == "expert_bias"

    def hf_shapes(self, mname: str) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of the HF tensors :meth:`to_hf` makes from ``mname`` (in order)."""
        import torch

        meta = torch.empty(self.megatron_shape(mname), device="meta")
        return {k: tuple(v.shape) for k, v in self.to_hf(mname, meta).items()}

    # ------------------------------------------------------------ checkpoint
    def checkpoint_key(self, mname: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """``(key, index, stack)`` of ``mname`` in megatron-core's distributed checkpoint.

        The stored tensor under ``key`` has global shape ``(*stack, *full shape)`` and ``mname`` is
        the piece at ``index`` on those leading axes. Layer tensors of a model whose layers are all
        alike share one key (``decoder.layers.<TE-style suffix>``, ``stack = (num_layers,)``,
        ``index = (layer,)``; experts add the expert axis); a model mixing dense and MoE layers has
        a key per layer (``decoder.layers.<i>.<suffix>``; experts ``stack = (num_experts,)``).
        Other tensors have empty ``index`` and ``stack``. A tied model's output layer is stored as
        the embedding.
        """
        layer, kind = self._split(mname)
        if layer is None:
            if mname == OUTPUT_LAYER and self.tie_word_embeddings:
                return EMBEDDING, (), ()
            return mname, (), ()
        suffix = _LAYER_RE.match(mname).group(2)  # type: ignore[union-attr]
        index: tuple[int, ...] = ()
        stack: tuple[int, ...] = ()
        if kind in ("expert_fc1", "expert_fc2"):
            suffix = f"mlp.experts.experts.linear_{kind[len('expert_'):]}.weight"
            index, stack = (self.expert_index(mname),), (self.num_experts,)  # type: ignore[assignment]
        else:  # a MoE layer's pre-MLP norm too: the local spec's keys map names it after the fused fc1's norm
            suffix = _CKPT_SUFFIX.get(suffix, suffix)
        if self.stacked_layers:
            return "decoder.layers." + suffix, (layer, *index), (self.num_layers, *stack)
        return f"decoder.layers.{layer}." + suffix, index, stack

    def checkpoint_chunks(self, mname: str, tp: int, padded_vocab: int | None = None) -> list[CheckpointChunk]:
        """The pieces a TP=``tp`` model stores for ``mname`` (as megatron's ``sharded_state_dict``
        does): one per TP rank, two per rank for ``linear_fc1`` (its gate and up halves),
        one for replicated tensors. Vocab tensors cover ``padded_vocab`` rows. ``tp`` divides the model's
        widths (:meth:`~megatron_agentrl.parallel_layout.ParallelLayout.check_model`)."""
        lay = self.tp_layout(mname)
        shape = list(self.megatron_shape(mname))
        if lay.vocab:
            shape[0] = padded_vocab if padded_vocab is not None else shape[0]
        zero = (0,) * len(shape)
        if lay.gated and lay.partition_dim is None:  # an expert: not split over TP
            tp = 1
        elif lay.partition_dim is None or tp == 1 and not lay.gated:
            return [CheckpointChunk(zero, tuple(shape))]
        dim = lay.partition_dim
        if lay.gated:
            half = shape[0] // 2
            per = half // tp
            sizes = (per, *shape[1:])
            out = []
            for r in range(tp):
                out.append(CheckpointChunk((r * per, *zero[1:]), sizes))
                out.append(CheckpointChunk((half + r * per, *zero[1:]), sizes))
            return out
        per = shape[dim] // tp
        sizes = tuple(per if i == dim else s for i, s in enumerate(shape))
        return [CheckpointChunk(tuple(r * per if i == dim else 0 for i in range(len(shape))), sizes)
                for r in range(tp)]

    # ------------------------------------------------------------ conversion
    def to_megatron(self, mname: str, hf: Mapping[str, Tensor]) -> Tensor:
        """The full Megatron tensor for ``mname`` from full HF tensors (``hf`` holds at least
        :meth:`hf_names` of ``mname``). Vocab tensors are returned unpadded ``[vocab, hidden]``."""
        names = self.hf_names(mname)
        missing = [n for n in names if n not in hf]
        if missing:
            raise KeyError(f"Megatron '{mname}' needs HF tensors {missing}, which are missing")
        import torch

        _, kind = self._split(mname)
        ts = [hf[n] for n in names]
        if kind == "qkv":
            return self._interleave_qkv(*ts)
        if kind in _GATED_KINDS and len(ts) == 2:
            return torch.cat(ts, dim=0)
        return ts[0]

    def to_hf(self, mname: str, full: Tensor) -> dict[str, Tensor]:
        """HF tensors from the full (unpadded) Megatron tensor of ``mname``; inverse of :meth:`to_megatron`."""
        import torch

        names = self.hf_names(mname)
        _, kind = self._split(mname)
        if kind == "qkv":
            return dict(zip(names, self._deinterleave_qkv(full)))
        if kind in _GATED_KINDS and len(names) == 2:
            gate, up = torch.chunk(full, 2, dim=0)
            return {names[0]: gate, names[1]: up}
        return {names[0]: full}

    def _interleave_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        import torch

        g, d = self.num_kv_heads, self.head_dim
        per = self.num_heads // g
        tail = q.shape[1:]
        q = q.reshape(g, per * d, *tail)
        k = k.reshape(g, d, *tail)
        v = v.reshape(g, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *tail)

    def _deinterleave_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        import torch

        g, d = self.num_kv_heads, self.head_dim
        per = self.num_heads // g
        tail = qkv.shape[1:]
        x = qkv.reshape(g, (per + 2) * d, *tail)
        q, k, v = torch.split(x, [per * d, d, d], dim=1)
        return (q.reshape(g * per * d, *tail).contiguous(), k.reshape(g * d, *tail).contiguous(),
                v.reshape(g * d, *tail).contiguous())

    # ------------------------------------------------------------ TP shards
    def shard(self, mname: str, full: Tensor, tp_rank: int, tp_size: int,
              padded_vocab: int | None = None) -> Tensor:
        """TP rank ``tp_rank``'s shard of the full Megatron tensor (a new contiguous tensor).

        ``padded_vocab``: the padded vocab size for vocab-parallel tensors (default: the
        unpadded size, which must then divide by tp_size).
        """
        import torch

        lay = self.tp_layout(mname)
        if lay.partition_dim is None:
            return full.clone()
        if lay.vocab:
            target = padded_vocab if padded_vocab is not None else full.shape[0]
            if target < full.shape[0]:
                raise ValueError(f"{mname}: padded_vocab={target} < vocab rows {full.shape[0]}")
            if target > full.shape[0]:
                pad = full.new_zeros(target - full.shape[0], *full.shape[1:])
                full = torch.cat([full, pad], dim=0)
        if full.shape[lay.partition_dim] % (2 * tp_size if lay.gated else tp_size) != 0:
            raise ValueError(f"{mname}: dim {lay.partition_dim} of shape {tuple(full.shape)} "
                             f"does not split over tp={tp_size}")
        if lay.gated:
            gate, up = torch.chunk(full, 2, dim=0)
            return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank],
                              torch.chunk(up, tp_size, 0)[tp_rank]], dim=0).contiguous()
        return torch.chunk(full, tp_size, dim=lay.partition_dim)[tp_rank].contiguous()

    def unshard(self, mname: str, shards: Sequence[Tensor], strip_vocab: bool = True) -> Tensor:
        """The full Megatron tensor from all TP shards (in TP-rank order); vocab padding is
        removed when ``strip_vocab``. A replicated tensor returns the first shard."""
        import torch

        lay = self.tp_layout(mname)
        if lay.partition_dim is None:
            return shards[0]
        if lay.gated:
            halves = [torch.chunk(s, 2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        full = torch.cat(list(shards), dim=lay.partition_dim)
        if lay.vocab and strip_vocab:
            full = full[: self.vocab_size]
        return full
