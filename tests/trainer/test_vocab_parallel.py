"""Token log-probs and entropy from vocab-parallel logits (megatron_agentrl/megatron/vocab_parallel.py):
equal to log-softmax in plain torch (values and gradients; temperature, padded vocab, views, any chunk
size, bf16 logits), equal at TP=2 to TP=1, and holding no fp32 copy of the logits for the backward."""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.megatron.vocab_parallel import token_logprobs
from tests.support.dist_utils import run_distributed

V, REAL = 24, 21  # padded vocabulary, real entries
# logits of std 4 give log-probs of up to ~20 nats: fp32 rounding of the two summation orders is ~1e-6


def _case(dtype: torch.dtype = torch.float32, seed: int = 0, real: int = REAL):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 9, V, generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, real, (3, 8), generator=g)
    pad = torch.arange(V) >= real
    w_lp, w_ent = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    return logits, targets, pad, w_lp, w_ent


def _reference(logits: torch.Tensor, targets: torch.Tensor, pad: torch.Tensor, temperature: float):
    """Plain torch on the fp32 copy of ``logits[:, :-1]``: log-probs and entropy ``[b, s]``."""
    x = (logits[:, :-1].float() / temperature).masked_fill(pad, float("-inf"))
    logp = torch.log_softmax(x, -1)
    ent = -(logp.exp() * logp.masked_fill(pad, 0.0)).sum(-1)
    return logp.gather(-1, targets[..., None])[..., 0], ent


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 5, 100])
def test_equal_to_log_softmax_values_and_gradients(temperature: float, chunk_rows: int) -> None:
    logits, targets, pad, w_lp, w_ent = _case()
    lp, ent = token_logprobs(logits[:, :-1], targets, temperature=temperature, pad_mask=pad, with_entropy=True,
                             chunk_mb=chunk_rows * V * 4 / 2**20)
    ref_lp, ref_ent = _reference(logits, targets, pad, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), logits)
    (ref,) = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), logits, retain_graph=True)
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-5)
    assert grad[:, -1].abs().sum() == 0 and grad[..., REAL:].abs().sum() == 0  # unscored row, padded entries
    # log-probs alone: the entropy output unused, its gradient never formed
    lp2, none = token_logprobs(logits[:, :-1], targets, temperature=temperature, pad_mask=pad)
    assert none is None
    (grad2,) = torch.autograd.grad((lp2 * w_lp).sum(), logits)
    (ref2,) = torch.autograd.grad((ref_lp * w_lp).sum(), logits)
    torch.testing.assert_close(grad2, ref2, rtol=0, atol=1e-5)


def test_bf16_logits_give_fp32_results_and_bf16_gradients() -> None:
    logits, targets, pad, w_lp, w_ent = _case(torch.bfloat16)
    lp, ent = token_logprobs(logits[:, :-1], targets, pad_mask=pad, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets, pad, 1.0)  # the same bf16 values, computed in fp32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), logits)
    (ref,) = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, ref, rtol=0, atol=1e-2)  # bf16 rounding of the same fp32 numbers


def test_backward_keeps_no_fp32_copy_of_the_logits() -> None:
    """What autograd holds between forward and backward: the logits and a few numbers per token here;
    the fp32 softmax of every position on the plain path."""
    logits, targets, pad, _, _ = _case(torch.bfloat16)

    def saved_bytes(fn) -> int:
        ptrs: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptrs[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(ptrs.values())

    ours = saved_bytes(lambda: token_logprobs(logits[:, :-1], targets, pad_mask=pad, with_entropy=True))
    plain = saved_bytes(lambda: _reference(logits, targets, pad, 1.0))
    tokens = targets.numel()
    assert ours <= logits.numel() * 2 + tokens * 32, ours  # the bf16 logits + targets, masks, two fp32 per token
    assert plain >= tokens * V * 4, plain  # at least one fp32 [tokens, V]


def test_input_errors_name_the_value() -> None:
    logits, targets, pad, _, _ = _case()
    with pytest.raises(ValueError, match=r"logits \(3, 9, 24\) must be \[b, s, V\] and targets \(3, 8\)"):
        token_logprobs(logits, targets, pad_mask=pad)  # the last position has no target
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        token_logprobs(logits[:, :-1], targets, temperature=0)


def _tp2(rank: int, world: int, real: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, targets, pad, w_lp, w_ent = _case(seed=3, real=real)
        half = V // world
        shard = logits.detach()[..., rank * half:(rank + 1) * half].clone().requires_grad_()
        lp, ent = token_logprobs(shard[:, :-1], targets, temperature=0.8, pad_mask=pad[rank * half:(rank + 1) * half],
                                 vocab_start=rank * half, tp_group=dist.group.WORLD, with_entropy=True,
                                 chunk_mb=4 * half * 4 / 2**20)
        (grad,) = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), shard)
        return {"lp": lp.detach(), "ent": ent.detach(), "grad": grad}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("real", [REAL, 10])
def test_tp2_equals_tp1(real: int) -> None:
    """The vocabulary split over two ranks (the padded entries all on the second; with 10 real entries
    the second shard is padding only): every rank gets the full log-probs and entropy, and its shard
    of the full gradient."""
    logits, targets, pad, w_lp, w_ent = _case(seed=3, real=real)
    lp, ent = token_logprobs(logits[:, :-1], targets, temperature=0.8, pad_mask=pad, with_entropy=True)
    (grad,) = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), logits)
    outs = run_distributed(_tp2, 2, real, timeout_s=120)
    half = V // 2
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out["lp"], lp.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(out["ent"], ent.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(out["grad"], grad[..., rank * half:(rank + 1) * half], rtol=0, atol=1e-5)
