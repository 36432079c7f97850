"""Test support for MoE routing: an engine whose expert choice differs from the trainer's near ties."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pick_experts_in_bf16(model: torch.nn.Module) -> int:
    """Make every Qwen3-MoE router of ``model`` choose its top-k from router logits computed in bf16 (as an
    engine's bf16 kernel would) while it weights the chosen experts with its own fp32 probabilities: tokens near
    a tie go to another expert and nothing else changes. Returns how many routers were changed."""
    changed = 0
    for m in model.modules():
        if type(m).__name__ != "Qwen3MoeTopKRouter":
            continue

        def forward(hidden_states: torch.Tensor, m: torch.nn.Module = m) -> tuple[torch.Tensor, ...]:
            h = hidden_states.reshape(-1, m.hidden_dim)
            logits = F.linear(h, m.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            chosen = torch.topk(F.linear(h.bfloat16(), m.weight.bfloat16()).float(), m.top_k, dim=-1).indices
            top = probs.gather(1, chosen)
            if m.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        m.forward = forward
        changed += 1
    return changed
