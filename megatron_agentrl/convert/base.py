"""Megatron-core <-> Hugging Face weight mapping shared by every dense GPT family.

Pure tensor code (no torch.distributed): used by the actor (load / export), the offline
converters (``hf_to_megatron``, ``megatron_to_hf``) and the live weight sync alike. A family
module (``qwen2.py``, ``qwen3.py``, ``llama.py``, ``glm4.py``) subclasses :class:`GPTMapping` and sets
its class flags; everything else is shared.

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
* **Checkpoint key**: the key of megatron-core's distributed checkpoint
  (``GPTModel.sharded_state_dict()``): layer tensors of all layers are one global tensor
  ``[num_layers, *full shape]`` under ``decoder.layers.<TE-style suffix>``; the vocab
  tensors are stored padded (``[padded_vocab, hidden]``) and loaded with
  ``allow_shape_mismatch``, so another padding (another TP) still loads.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_agentrl.config import ConfigError

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"

HF_EMBEDDING = "model.embed_tokens.weight"
HF_LM_HEAD = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

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
# Local layer-spec suffix -> the suffix megatron-core's sharded_state_dict stores it under
# (the local spec's ``sharded_state_dict_keys_map``; TE names are stored as they are).
_CKPT_SUFFIX = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class ConversionError(ConfigError):
    """A checkpoint or conversion request that cannot be honoured; the message names the bad
    value (path, tensor, size) and the fix."""


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= vocab_size."""
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


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
    * :meth:`_qkv_bias`: whether q/k/v projections carry a bias.

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
        self._suffix_kind = dict(_LAYER_SUFFIX_KIND)
        if self.post_norms:
            self._suffix_kind.update(_POST_NORM_SUFFIX_KIND)
        if self.qk_norms:
            self._suffix_kind.update(_QK_NORM_SUFFIX_KIND)

    def _qkv_bias(self, hf_config: Any) -> bool:
        """Whether q/k/v carry a bias in this family (subclasses override)."""
        return False

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
        return self.tie_word_embeddings and name == HF_LM_HEAD

    def _split(self, mname: str) -> tuple[int | None, str]:
        if mname in (EMBEDDING, OUTPUT_LAYER, FINAL_NORM):
            return None, mname
        m = _LAYER_RE.match(mname)
        if not m or m.group(2) not in self._suffix_kind:
            raise KeyError(f"'{mname}' is not a Megatron parameter name of a {self.model_type} GPTModel")
        layer = int(m.group(1))
        if layer >= self.num_layers:
            raise KeyError(f"'{mname}': layer {layer} out of range (num_hidden_layers={self.num_layers})")
        return layer, self._suffix_kind[m.group(2)]

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
        return [p + "mlp.down_proj.weight"]  # fc2

    def tp_layout(self, mname: str) -> TPLayout:
        """How ``mname`` is split over TP ranks (see :class:`TPLayout`)."""
        layer, kind = self._split(mname)
        if layer is None:
            return TPLayout(0, vocab=True) if kind in (EMBEDDING, OUTPUT_LAYER) else TPLayout(None)
        if kind == "qkv":
            return TPLayout(0)
        if kind == "fc1":
            return TPLayout(0, gated=True)
        if kind in ("proj", "fc2"):
            return TPLayout(1)
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
        return (h,)  # norms

    def hf_shapes(self, mname: str) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of the HF tensors :meth:`to_hf` makes from ``mname`` (in order)."""
        meta = torch.empty(self.megatron_shape(mname), device="meta")
        return {k: tuple(v.shape) for k, v in self.to_hf(mname, meta).items()}

    # ------------------------------------------------------------ checkpoint
    def checkpoint_key(self, mname: str) -> tuple[str, int | None]:
        """``(key, layer)`` of ``mname`` in megatron-core's distributed checkpoint.

        Layer tensors share one key for all layers (``decoder.layers.<TE-style suffix>``,
        global shape ``[num_layers, *full shape]``) and ``layer`` is the index on the stacked
        axis; other tensors return ``layer=None``. A tied model's output layer is stored as
        the embedding.
        """
        layer, _ = self._split(mname)
        if layer is None:
            if mname == OUTPUT_LAYER and self.tie_word_embeddings:
                return EMBEDDING, None
            return mname, None
        suffix = _LAYER_RE.match(mname).group(2)  # type: ignore[union-attr]
        return "decoder.layers." + _CKPT_SUFFIX.get(suffix, suffix), layer

    def checkpoint_chunks(self, mname: str, tp: int, padded_vocab: int | None = None) -> list[CheckpointChunk]:
        """The pieces a TP=``tp`` model stores for ``mname`` (as megatron's ``sharded_state_dict``
        does): one per TP rank, two per rank for ``linear_fc1`` (its gate and up halves),
        one for replicated tensors. Vocab tensors cover ``padded_vocab`` rows."""
        lay = self.tp_layout(mname)
        shape = list(self.megatron_shape(mname))
        if lay.vocab:
            shape[0] = padded_vocab if padded_vocab is not None else shape[0]
        zero = (0,) * len(shape)
        if lay.partition_dim is None or tp == 1 and not lay.gated:
            return [CheckpointChunk(zero, tuple(shape))]
        dim = lay.partition_dim
        if lay.gated:
            half = shape[0] // 2
            if half % tp:
                raise ConversionError(f"{mname}: intermediate_size={half} does not split over tp={tp}")
            per = half // tp
            sizes = (per, *shape[1:])
            out = []
            for r in range(tp):
                out.append(CheckpointChunk((r * per, *zero[1:]), sizes))
                out.append(CheckpointChunk((half + r * per, *zero[1:]), sizes))
            return out
        if shape[dim] % tp:
            raise ConversionError(f"{mname}: dim {dim} of shape {tuple(shape)} does not split over tp={tp}")
        per = shape[dim] // tp
        sizes = tuple(per if i == dim else s for i, s in enumerate(shape))
        return [CheckpointChunk(tuple(r * per if i == dim else 0 for i in range(len(shape))), sizes)
                for r in range(tp)]

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise ConversionError unless this model splits over ``tp`` x ``pp`` (heads, KV heads,
        FFN width by TP; layers by PP)."""
        if tp < 1 or pp < 1:
            raise ConversionError(f"tp={tp}, pp={pp}: both must be positive integers")
        bad = [f"{what}={n}" for what, n in (("num_attention_heads", self.num_heads),
                                             ("num_key_value_heads", self.num_kv_heads),
                                             ("intermediate_size", self.intermediate_size)) if n % tp]
        if bad:
            divisors = [t for t in range(1, self.num_kv_heads + 1)
                        if self.num_kv_heads % t == 0 and self.num_heads % t == 0 and self.intermediate_size % t == 0]
            raise ConversionError(f"tp={tp} does not divide {', '.join(bad)}; choose tp in {divisors}")
        if self.num_layers % pp:
            divisors = [p for p in range(1, self.num_layers + 1) if self.num_layers % p == 0]
            raise ConversionError(
                f"pp={pp} does not divide num_hidden_layers={self.num_layers}; choose pp in {divisors}")

    # ------------------------------------------------------------ conversion
    def to_megatron(self, mname: str, hf: Mapping[str, Tensor]) -> Tensor:
        """The full Megatron tensor for ``mname`` from full HF tensors (``hf`` holds at least
        :meth:`hf_names` of ``mname``). Vocab tensors are returned unpadded ``[vocab, hidden]``."""
        names = self.hf_names(mname)
        missing = [n for n in names if n not in hf]
        if missing:
            raise KeyError(f"Megatron '{mname}' needs HF tensors {missing}, which are missing")
        _, kind = self._split(mname)
        ts = [hf[n] for n in names]
        if kind == "qkv":
            return self._interleave_qkv(*ts)
        if kind == "fc1" and len(ts) == 2:
            return torch.cat(ts, dim=0)
        return ts[0]

    def to_hf(self, mname: str, full: Tensor) -> dict[str, Tensor]:
        """HF tensors from the full (unpadded) Megatron tensor of ``mname``; inverse of :meth:`to_megatron`."""
        names = self.hf_names(mname)
        _, kind = self._split(mname)
        if kind == "qkv":
            return dict(zip(names, self._deinterleave_qkv(full)))
        if kind == "fc1" and len(names) == 2:
            gate, up = torch.chunk(full, 2, dim=0)
            return {names[0]: gate, names[1]: up}
        return {names[0]: full}

    def _interleave_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g, d = self.num_kv_heads, self.head_dim
        per = self.num_heads // g
        tail = q.shape[1:]
        q = q.reshape(g, per * d, *tail)
        k = k.reshape(g, d, *tail)
        v = v.reshape(g, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *tail)

    def _deinterleave_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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
