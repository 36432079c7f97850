"""Core attention for layer specs without TransformerEngine: PyTorch SDPA, padded or packed (THD),
with or without context parallelism.

megatron-core's local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores and refuses
packed sequences and context parallelism; TransformerEngine's attention takes all three but needs
CUDA. This module has the constructor and forward signature of a megatron core attention
(``SelfAttentionSubmodules.core_attention``), so it goes into the layer spec by composition, on CPU
and on GPUs without TE:

* ``[s, b, heads, d]`` queries/keys/values (right-padded rows): one causal SDPA call;
* THD (``packed_seq_params.qkv_format == "thd"``, ``[t, heads, d]``): causal attention within each
  sequence of ``cu_seqlens`` (a block-diagonal causal mask), one SDPA call per sequence, so the cost
  is ``sum(len_i ** 2)`` rather than ``t ** 2``.

Context parallelism (``config.context_parallel_size`` = cp > 1): each rank holds megatron's
load-balanced shard of every sequence (chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp``; see
``context_parallel.py``). Keys and values are all-gathered over the CP group (their gradient flows
back by a reduce-scatter), put in sequence order, and each local query chunk attends causally to
the keys up to its own global position: one SDPA call per chunk, over the keys before the chunk's
end. For THD, ``cu_seqlens`` are those of the full (unsharded) packed row, every sequence a multiple
of ``2 * cp`` long, as megatron and TransformerEngine expect. The CP communication is always an
all-gather of K/V (``cp_comm_type`` is accepted and not used).

Grouped-query attention uses SDPA's ``enable_gqa``; the softmax scale is the config's (default
``1 / sqrt(head_dim)``). A given ``attention_mask`` (megatron's convention: True = masked) replaces
the causal mask (not with context parallelism, where the mask would have to follow the shards).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megatron_agentrl.megatron.context_parallel import all_gather_sequence, full_order


class SDPACoreAttention(MegatronModule):
    """Causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args follow megatron-core's ``DotProductAttention``; the CP group is ``pg_collection.cp`` when
    given, else megatron's ``parallel_state`` context-parallel group.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention is causal self-attention; attn_mask_type={attn_mask_type} "
                             "is not supported")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPACoreAttention: apply_query_key_layer_scaling is not supported")
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)
        self.cp = int(config.context_parallel_size)
        self._cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def _group(self) -> Any:
        if self._cp_group is None:
            from megatron.core import parallel_state

            self._cp_group = parallel_state.get_context_parallel_group()
        return self._cp_group

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """``[n, heads, s, d]`` attention; ``mask`` (True = attend) or causal."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        """Padded: ``query [sq, b, heads, d]``, ``key/value [sk, b, groups, d]`` -> ``[sq, b, heads * d]``.
        THD: ``query [t, heads, d]``, ``key/value [t, groups, d]`` -> ``[t, heads, d]``.
        With CP, ``sq`` / ``t`` are this rank's shard (``1 / cp`` of the sequence)."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if self.cp > 1 and attention_mask is not None:
            raise ValueError("SDPACoreAttention: an explicit attention_mask is not supported with context "
                             f"parallelism (context_parallel_size={self.cp}); pass None (causal)")
        mask = None if attention_mask is None else ~attention_mask.bool()
        sq, b = query.shape[0], query.shape[1]
        if self.cp > 1:
            # [s_local, b, g, d] of every CP rank -> the whole sequence, in sequence order
            width = sq * self.cp
            order = full_order([0, width], self.cp, key.device)
            key, value = (all_gather_sequence(x, self._group()).index_select(0, order) for x in (key, value))
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend_cp_shard(q, k, v) if self.cp > 1 else self._sdpa(q, k, v, mask)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _attend_cp_shard(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One sequence's local query shard ``q [n, h, L / cp, d]`` (chunks ``r``, ``2cp-1-r`` of ``2cp``)
        against its whole keys/values ``[n, g, L, d]`` (sequence order): ``[n, h, L / cp, d]``."""
        cp = self.cp
        rank = torch.distributed.get_rank(self._group())
        c = k.shape[2] // (2 * cp)
        outs = []
        for i, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            start = chunk * c
            qi = q[:, :, i * c:(i + 1) * c]
            # the chunk's queries see the keys up to their own global position: keys [0, start + c)
            ki, vi = k[:, :, :start + c], v[:, :, :start + c]
            mask = None
            if start:
                mask = (torch.arange(start + c, device=q.device)[None, :]
                        <= (start + torch.arange(c, device=q.device))[:, None])
            outs.append(self._sdpa(qi, ki, vi, mask))
        return torch.cat(outs, dim=2)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, params: Any) -> Tensor:
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_q is None or cu_kv is None or not torch.equal(cu_q, cu_kv):
            raise ValueError("SDPACoreAttention (THD): self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = cu_q.tolist()
        total = query.shape[0] * self.cp  # cu_seqlens are those of the full packed row
        if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"SDPACoreAttention (THD): cu_seqlens {bounds} must rise from 0 to the packed "
                             f"length {total}" + (f" (this rank's {query.shape[0]} tokens x cp={self.cp})"
                                                  if self.cp > 1 else ""))
        if self.cp > 1:
            order = full_order(bounds, self.cp, key.device)  # validates lengths: multiples of 2 * cp
            key, value = (all_gather_sequence(x, self._group()).index_select(0, order) for x in (key, value))
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            # this rank's part of the sequence: [start / cp, end / cp) of the local tokens
            qs, qe = start // self.cp, end // self.cp
            # [L, h, d] -> [1, h, L, d] -> [L, h, d]
            q = query[qs:qe].transpose(0, 1).unsqueeze(0)
            k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (key, value))
            out = self._attend_cp_shard(q, k, v) if self.cp > 1 else self._sdpa(q, k, v, None)
            pieces.append(out[0].transpose(0, 1))
        return torch.cat(pieces, dim=0)
