"""Core attention for layer specs without TransformerEngine: PyTorch SDPA, padded or packed (THD).

megatron-core's local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores and refuses
packed sequences; TransformerEngine's attention takes both but needs CUDA. This module has the
constructor and forward signature of a megatron core attention (``SelfAttentionSubmodules.
core_attention``), so it goes into the layer spec by composition, on CPU and on GPUs without TE:

* ``[s, b, heads, d]`` queries/keys/values (right-padded rows): one causal SDPA call;
* THD (``packed_seq_params.qkv_format == "thd"``, ``[t, heads, d]``): causal attention within each
  sequence of ``cu_seqlens`` (a block-diagonal causal mask), one SDPA call per sequence, so the cost
  is ``sum(len_i ** 2)`` rather than ``t ** 2``.

Grouped-query attention uses SDPA's ``enable_gqa``; the softmax scale is the config's (default
``1 / sqrt(head_dim)``). A given ``attention_mask`` (megatron's convention: True = masked) replaces
the causal mask.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


class SDPACoreAttention(MegatronModule):
    """Causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args follow megatron-core's ``DotProductAttention``; context parallelism is not supported
    (``config.context_parallel_size`` must be 1).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism "
                             f"(context_parallel_size={config.context_parallel_size})")
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

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """``[n, heads, s, d]`` attention; ``mask`` (True = attend) or causal."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        """Padded: ``query [sq, b, heads, d]``, ``key/value [sk, b, groups, d]`` -> ``[sq, b, heads * d]``.
        THD: ``query [t, heads, d]``, ``key/value [t, groups, d]`` -> ``[t, heads, d]``."""
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported")
        mask = None if attention_mask is None else ~attention_mask.bool()
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, mask)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, params: Any) -> Tensor:
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_q is None or cu_kv is None or not torch.equal(cu_q, cu_kv):
            raise ValueError("SDPACoreAttention (THD): self-attention needs cu_seqlens_q == cu_seqlens_kv")
        bounds = cu_q.tolist()
        if bounds[0] != 0 or bounds[-1] != query.shape[0] or any(b > a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"SDPACoreAttention (THD): cu_seqlens {bounds} must rise from 0 to the packed "
                             f"length {query.shape[0]}")
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end > start:
                # [L, h, d] -> [1, h, L, d] -> [L, h, d]
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                pieces.append(self._sdpa(q, k, v, None)[0].transpose(0, 1))
        return torch.cat(pieces, dim=0)
