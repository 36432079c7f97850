"""MoE rollout routing replay (R3, ``megatron_agentrl.megatron.routing_replay``): the actor's forwards route each
token to the experts of ``routed_experts``.

On tiny Qwen3-MoE / GLM-4.5 models (fp32, gloo, 2 processes) at several layouts (EP=2, TP=2 with sequence
parallelism, PP=2 with full recompute over several micro-batches, CP=2; padded rows and packed sequences):
(a) replaying the trainer's own routing changes nothing (log-probs, loss statistics, gradients); (b) replaying a
routing with flipped experts gives the log-probs of a Hugging Face forward whose routers are forced to the same
experts (atol 1e-4, the dense consistency bound), and the same loss and gradients at every layout; (c)
``routing/flip_rate`` is 0 for the trainer's own routing and the known share of flipped (token, layer) pairs
otherwise, with replay on and off; (d) routing of the wrong shape or ids is refused with a clear message.
"""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.config import LossConfig, TrainConfig
from tests.support.dist_utils import run_distributed

VOCAB = 150
LENGTHS, STARTS = [21, 5, 17, 9, 14, 3], [2, 1, 4, 2, 6, 1]


# ------------------------------------------------------------------ helpers (Hugging Face side)
def _per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (``experts.gate_up_proj``, ``experts.down_proj``) under the per-expert names
    of checkpoints, which the actor loads."""
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            half, prefix = v.shape[1] // 2, k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = v[e, :half], v[e, half:]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def _hf_forward(model, tokens: torch.Tensor, forced: torch.Tensor | None = None):
    """Log-probs ``[B, T]`` of ``tokens`` under the HF ``model`` and the experts each MoE layer chose ``[B, T, M, K]``;
    with ``forced [B, T, M, K]`` its routers take those experts (rows of -1: their own), weighted as the family's
    router weights its own choice (Qwen3-MoE: softmax over all experts, renormalised over the chosen; GLM-4.5:
    sigmoid scores, renormalised, scaled)."""
    cfg = model.config
    B, T = tokens.shape
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    chosen: list[torch.Tensor] = []

    def hook(m: int):
        def fn(module, args, output):
            logits, weights, idx = output
            if forced is None:
                chosen.append(idx)
                return output
            target = forced[:, :, m].reshape(B * T, -1).long()
            idx = torch.where((target >= 0).all(-1, keepdim=True), target, idx)
            if cfg.model_type == "glm4_moe":
                w = logits.sigmoid().gather(1, idx)
                w = (w / (w.sum(-1, keepdim=True) + 1e-20) if cfg.norm_topk_prob else w) * cfg.routed_scaling_factor
            else:
                w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
                w = w / w.sum(-1, keepdim=True) if cfg.norm_topk_prob else w
            chosen.append(idx)
            return logits, w.to(weights.dtype), idx
        return fn

    handles = [g.register_forward_hook(hook(m)) for m, g in enumerate(gates)]
    try:
        with torch.no_grad():
            logits = model(tokens).logits.float()
    finally:
        for h in handles:
            h.remove()
    lp = torch.zeros(B, T)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return lp, torch.stack([c.reshape(B, T, -1) for c in chosen], dim=2)


def _routings(model, batch):
    """(own, flipped at every MoE layer, flipped at the last MoE layer only, share flipped of each) as an engine
    would give them: the HF model's own routing with -1 at each row's last token and padding; flipped: every
    third position of each row swaps one expert for one the token did not choose."""
    n = torch.tensor(LENGTHS)
    _, own = _hf_forward(model, batch.tokens)
    B, T, M, K = own.shape
    covered = torch.arange(T)[None] < (n[:, None] - 1)  # the engine gives no routing for the last token
    own = torch.where(covered[:, :, None, None], own, torch.full_like(own, -1)).to(torch.int16)
    flip_at = covered & (torch.arange(T)[None] % 3 == 1)
    experts = model.config.num_experts if model.config.model_type == "qwen3_moe" else model.config.n_routed_experts

    def flipped(layers: list[int]) -> torch.Tensor:
        out = own.clone()
        for b, t in flip_at.nonzero().tolist():
            for m in layers:
                taken = set(out[b, t, m].tolist())
                out[b, t, m, 0] = min(e for e in range(experts) if e not in taken)
        return out

    pairs, flips = float(covered.sum()) * M, float(flip_at.sum())
    return own, flipped(list(range(M))), flipped([M - 1]), flips * M / pairs, flips / pairs


# ------------------------------------------------------------------ the actor at several layouts (2 processes)
def _layouts(rank: int, world: int, family: str, layouts: list[tuple]) -> dict:
    import dataclasses

    from megatron_agentrl.megatron.actor import MegatronActor
    from tests.support.tiny_models import ragged_batch, reinit_parallel, tiny_model
    from tests.trainer.support import hf_state

    cfg, hf = tiny_model(family, vocab=VOCAB)
    state = _per_expert(hf_state(hf))
    batch = ragged_batch(VOCAB, LENGTHS, STARTS, seed=5, ref=True)
    own, flip_all, flip_last, share_all, share_last = _routings(hf, batch)
    hf_lp, _ = _hf_forward(hf, batch.tokens)
    hf_forced, used = _hf_forward(hf, batch.tokens, flip_all)
    assert torch.equal(used[flip_all >= 0], flip_all[flip_all >= 0].long())
    mask = batch.loss_mask
    out: dict = {"share_all": share_all, "share_last": share_last,
                 "flip_moves_hf": float(((hf_forced - hf_lp) * mask).abs().max())}
    refs: dict = {}
    for tp, pp, ep, cp, packed, recompute, replay in layouts:
        reinit_parallel(tp, pp, ep=ep, cp=cp, seed=7)
        tcfg = TrainConfig(micro_batch_size=1 if pp > 1 else 2, sequence_packing=packed, recompute=recompute,
                           micro_batch_tokens=24 if packed and pp > 1 else 0, moe_routing_replay=replay)
        actor = MegatronActor(cfg, tcfg, LossConfig(tis_cap=2.0, kl_coef=0.1))
        actor.load_hf_state_dict(state)
        key = f"tp{tp}pp{pp}ep{ep}cp{cp}-{'packed' if packed else 'padded'}-{recompute}-{'on' if replay else 'off'}"
        r: dict = {}
        lp = actor.compute_logprobs(batch.tokens, 1.0, 2, loss_mask=mask)
        r["plain_vs_hf"] = float(((lp - hf_lp) * mask).abs().max())
        lp_own = actor.compute_logprobs(batch.tokens, 1.0, 2, loss_mask=mask, routed_experts=own)
        r["own_vs_plain"] = float(((lp_own - lp) * mask).abs().max())
        lp_flip = actor.compute_logprobs(batch.tokens, 1.0, 2, loss_mask=mask, routed_experts=flip_all)
        r["flip_vs_hf_forced"] = float(((lp_flip - hf_forced) * mask).abs().max())
        r["flip_vs_hf"] = float(((lp_flip - hf_lp) * mask).abs().max())
        actor.snapshot_reference()
        ref_flip = actor.compute_ref_logprobs(batch.tokens, mask, routed_experts=flip_all)
        r["ref_vs_flip"] = float(((ref_flip - lp_flip) * mask).abs().max())
        grads, stats = {}, {}
        for name, routing in (("plain", None), ("own", own), ("flip_all", flip_all), ("flip_last", flip_last)):
            b = dataclasses.replace(batch, ref_logprobs=hf_lp, routed_experts=routing)
            stats[name] = actor.compute_grads(actor.dp_slice(b), "grpo")
            grads[name] = actor.export_hf_grads()
        for name in ("own", "flip_all"):  # (a) own routing = none; flipped: compared across layouts below
            scale = max(float(g.abs().max()) for g in grads["plain"].values())
            r[f"grad_{name}_vs_plain"] = max(float((grads[name][k] - grads["plain"][k]).abs().max())
                                             for k in grads["plain"]) / scale
            r[f"loss_{name}_vs_plain"] = max(abs(stats[name][k] - stats["plain"][k]) for k in stats["plain"]
                                             if not k.startswith(("moe/", "num_micro")))
        r["flip_rate"] = {k: s.get("routing/flip_rate") for k, s in stats.items()}
        r["stats_flip_all"] = stats["flip_all"]
        r["num_micro_batches"] = stats["flip_all"]["num_micro_batches"]
        ref = refs.setdefault((packed, replay), (grads["flip_all"], stats["flip_all"]))
        if ref[0] is not grads["flip_all"]:
            scale = max(float(g.abs().max()) for g in ref[0].values())
            r["flip_grad_vs_ref_layout"] = max(float((grads["flip_all"][k] - ref[0][k]).abs().max())
                                               for k in ref[0]) / scale
            r["flip_loss_vs_ref_layout"] = max(abs(stats["flip_all"][k] - ref[1][k]) for k in ref[1]
                                               if not k.startswith(("moe/", "num_micro", "routing/")))
        out[key] = r
    return out


def _check(out: dict) -> None:
    assert out["flip_moves_hf"] > 1e-2, out["flip_moves_hf"]  # the flipped experts matter
    for key, r in out.items():
        if not isinstance(r, dict):
            continue
        replay = key.endswith("-on")
        assert r["plain_vs_hf"] < 1e-4, (key, r)
        assert r["own_vs_plain"] < 1e-6, (key, r)  # (a)
        assert r["grad_own_vs_plain"] < 1e-6 and r["loss_own_vs_plain"] < 1e-6, (key, r)
        if replay:  # (b)
            assert r["flip_vs_hf_forced"] < 1e-4, (key, r)
            assert r["ref_vs_flip"] < 1e-6, (key, r)
            assert r["grad_flip_all_vs_plain"] > 1e-3, (key, r)
        else:  # replay off: the routing is observed only
            assert r["flip_vs_hf"] < 1e-4 and r["grad_flip_all_vs_plain"] < 1e-6, (key, r)
        if "flip_grad_vs_ref_layout" in r:
            assert r["flip_grad_vs_ref_layout"] < 1e-5 and r["flip_loss_vs_ref_layout"] < 1e-5, (key, r)
        # (c): none without routing, 0 for the trainer's own, the known share for flips (at the last MoE layer
        # only with replay on: flips at an earlier layer move the hidden states of the later ones)
        rates = r["flip_rate"]
        assert rates["plain"] is None and rates["own"] == 0.0, (key, rates)
        assert rates["flip_last"] == pytest.approx(out["share_last"], abs=1e-12), (key, rates)
        if not replay:
            assert rates["flip_all"] == pytest.approx(out["share_all"], abs=1e-12), (key, rates)
        else:
            assert rates["flip_all"] >= out["share_last"], (key, rates)
        if "pp2" in key:
            assert r["num_micro_batches"] >= 3, (key, r)


# (tp, pp, ep, cp, packed, recompute, replay): the first of each (packed, replay) is the reference layout
PADDED = [(1, 1, 1, 1, False, "none", True), (1, 1, 2, 1, False, "none", True), (2, 1, 1, 1, False, "none", True),
          (1, 2, 1, 1, False, "full", True), (1, 1, 1, 1, False, "none", False)]
PACKED = [(1, 1, 1, 1, True, "none", True), (1, 1, 2, 1, True, "none", True), (1, 2, 1, 1, True, "full", True),
          (1, 1, 1, 2, True, "none", True)]
SLOW = [(1, 1, 1, 1, False, "none", True), (1, 1, 1, 2, False, "none", True), (1, 1, 1, 1, True, "none", True),
        (2, 1, 1, 1, True, "full", True), (1, 1, 2, 1, True, "full", True), (1, 1, 2, 1, True, "none", False),
        (2, 1, 1, 1, False, "none", False)]


def test_replay_at_ep_tp_pp_padded():
    """Qwen3-MoE, padded rows: EP=2, TP=2 (sequence parallel), PP=2 with full recompute over several micro-batches,
    replay on (and off at EP=1): (a), (b), (c) of the module's docstring."""
    _check(run_distributed(_layouts, 2, "qwen3_moe", PADDED, timeout_s=600)[0])


def test_replay_at_ep_pp_cp_packed():
    """Qwen3-MoE, packed sequences: EP=2, PP=2 with full recompute over several micro-batches, CP=2 (the routing is
    cut like the tokens, not shifted like the loss's fields): (a), (b), (c) of the module's docstring."""
    _check(run_distributed(_layouts, 2, "qwen3_moe", PACKED, timeout_s=600)[0])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_replay_at_more_layouts(family):
    """CP=2 (padded), TP=2 and EP=2 with recompute, replay off at EP=2 and TP=2; GLM-4.5 (a dense
    first layer: one MoE layer, on the second pipeline stage; a router bias; a shared expert)."""
    layouts = SLOW if family == "qwen3_moe" else PADDED
    _check(run_distributed(_layouts, 2, family, layouts, timeout_s=600)[0])


# ------------------------------------------------------------------ refusals (1 process)
def _refusals(rank: int, world: int) -> dict:
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from tests.support.tiny_models import ragged_batch, reinit_parallel, tiny_config

    reinit_parallel(1, 1)
    actor = MegatronActor(tiny_config("qwen3_moe", vocab=VOCAB), TrainConfig(moe_routing_replay=True))
    batch = ragged_batch(VOCAB, [6, 4], [1, 1], seed=1)
    B, T = batch.tokens.shape
    good = torch.zeros(B, T, 2, 2, dtype=torch.int16)
    good[..., 1] = 1
    errors = {}
    cases = {"layers": good[:, :, :1], "topk": torch.zeros(B, T, 2, 3, dtype=torch.int16), "width": good[:, :-1],
             "float": good.float(), "id": good + 3, "below": good - 2,
             "partial": torch.where(torch.arange(2) == 0, good, -1).to(torch.int16), "repeat": torch.zeros_like(good)}
    for name, routed in cases.items():
        for what in ("logprobs", "grads"):
            try:
                if what == "logprobs":
                    actor.compute_logprobs(batch.tokens, loss_mask=batch.loss_mask, routed_experts=routed)
                else:
                    actor.compute_grads(TrainBatch(batch.tokens, batch.loss_mask, batch.behavior_logprobs,
                                                   batch.advantages, routed_experts=routed))
                errors[name, what] = None
            except ValueError as e:
                errors[name, what] = str(e)
    stats = actor.compute_grads(TrainBatch(batch.tokens, batch.loss_mask, batch.behavior_logprobs,
                                           batch.advantages, routed_experts=torch.full_like(good, -1)))
    errors["all -1 flip rate"] = stats["routing/flip_rate"]
    dense = MegatronActor(tiny_config("qwen2", vocab=VOCAB), TrainConfig())
    try:
        dense.compute_logprobs(batch.tokens, routed_experts=good)
    except ValueError as e:
        errors["dense"] = str(e)
    return errors


def test_bad_routing_is_refused():
    """(d) routed_experts of the wrong layers, top-k, width or dtype, ids outside [-1, experts), a token with some
    experts -1, a repeated expert, and routing for a dense model: refused by compute_logprobs and compute_grads with
    a message naming the problem; all -1 (nothing given) is accepted."""
    e = run_distributed(_refusals, 1, timeout_s=300)[0]
    for what in ("logprobs", "grads"):
        assert "needs [B, T, M, K] = [2, 6, 2, 2]" in e["layers", what] and "2 MoE layers" in e["layers", what]
        assert "top-2 of 4 experts" in e["topk", what] and "(2, 6, 2, 3)" in e["topk", what]
        assert "(2, 5, 2, 2)" in e["width", what]
        assert "must be an integer tensor (int16), got torch.float32" in e["float", what]
        assert "expert ids in [3, 4]; this model has 4 experts" in e["id", what]
        assert "expert ids in [-2, -1]" in e["below", what]
        assert "mixes expert ids and -1" in e["partial", what]
        assert "repeats an expert" in e["repeat", what]
    assert e["layers", "grads"].startswith("batch.routed_experts has shape")
    assert e["all -1 flip rate"] == 0.0
    assert "model_type='qwen2' has no MoE layer" in e["dense"]


def test_pack_pads_routing_with_minus_one():
    """Packing keeps a field's trailing dims ([B, T, M, K] -> [1, t, M, K]) and pads it with its fill value."""
    from megatron_agentrl.megatron.packing import pack

    routed = torch.arange(2 * 3 * 2 * 1, dtype=torch.int16).reshape(2, 3, 2, 1)
    p = pack({"tokens": torch.ones(2, 3, dtype=torch.long), "routed_experts": routed}, [1, 0], [2, 3], pad_to=10,
             multiple=4, fill={"routed_experts": -1})
    assert p.fields["routed_experts"].shape == (1, 10, 2, 1)
    got = p.fields["routed_experts"][0, :, 0, 0].tolist()
    assert got == [6, 8, 10, -1, 0, 2, -1, -1, -1, -1]
    assert p.fields["tokens"][0].tolist() == [1, 1, 1, 0, 1, 1, 0, 0, 0, 0]
