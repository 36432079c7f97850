"""Tiny random Hugging Face models of each family (Qwen2, Qwen3, Llama, GLM-4, Qwen3-MoE, GLM-4.5 MoE), written with
``transformers``, and a megatron forward that returns full-vocab logits at any TP x PP: shared by
the conversion, Megatron actor and checkpoint tests."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen2", "qwen3", "llama", "glm4", "qwen3_moe", "glm4_moe")
MOE_FAMILIES = ("qwen3_moe", "glm4_moe")
VOCAB = 300  # padded to 384 at TP=1 and 512 at TP=2: the padding differs between layouts


def tiny_config(family: str, tied: bool = False, vocab: int = VOCAB, layers: int = 2):
    """A tiny transformers config of ``family`` (4 heads, 2 KV heads, head_dim 16; 24 for qwen3); the MoE
    families have 4 experts of width 32, 2 per token (GLM-4.5: a shared expert, the first layer dense)."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen2":
        return T.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if family == "qwen3":  # head_dim 24: q/k/v widths differ from hidden_size, as in Qwen3-0.6B
        return T.Qwen3Config(**{**common, "head_dim": 24},
                             rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if family == "llama":
        # Llama 3.x rope scaling (megatron fixes low/high freq factors 1/4 and 8192 positions)
        return T.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if family == "glm4":
        return T.Glm4Config(**common, attention_bias=True, rope_parameters={
            "rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**common, **moe, num_experts=4, norm_topk_prob=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if family == "glm4_moe":
        return T.Glm4MoeConfig(**common, **moe, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                               routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                "partial_rotary_factor": 0.5})
    raise ValueError(family)


def tiny_model(family: str, tied: bool = False, vocab: int = VOCAB, layers: int = 2, seed: int = 0):
    """A tiny random ``*ForCausalLM`` of ``family`` (fp32, eval) with every weight randomised."""
    import transformers as T

    cfg = tiny_config(family, tied, vocab, layers)
    cls = {"qwen2": T.Qwen2ForCausalLM, "qwen3": T.Qwen3ForCausalLM, "llama": T.LlamaForCausalLM,
           "glm4": T.Glm4ForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM, "glm4_moe": T.Glm4MoeForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # GLM-4.5's router bias chooses experts: make it matter
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return cfg, model


def write_tiny_checkpoint(family: str, out: Path, tied: bool = False, dtype: torch.dtype = torch.float32,
                          max_shard_size: str | None = None, tokenizer: bool = True, **kw):
    """Save a tiny model of ``family`` to ``out`` with ``save_pretrained`` (plus a small
    tokenizer.json / tokenizer_config.json when ``tokenizer``); returns the model."""
    cfg, model = tiny_model(family, tied, **kw)
    model = model.to(dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **extra)
    if tokenizer:
        (out / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}\n')
        (out / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}\n')
    return model


def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``d``."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reinit_parallel(tp: int, pp: int, ep: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """(Re)initialise megatron's groups at ``tp`` x ``pp`` (x ``ep``, x ``cp``) on the current processes."""
    from megatron.core import parallel_state

    from megatron_agentrl.megatron.parallel import initialize_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_parallel(tp, pp, seed=seed, timeout_s=60, ep=ep, cp=cp)


def tiny_qwen2_config(vocab: int = 150):
    """A tiny Qwen2 config (width 32, 2 layers, 4 heads, 2 KV heads, untied) for the actor's layout comparisons."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})


def layout_actor(cfg, state: dict[str, torch.Tensor] | None, micro_batch_size: int, micro_batch_tokens: int,
                 sequence_packing: bool, recompute: str):
    """A Megatron actor of ``cfg`` on the current layout (seed 11; GRPO with TIS cap 2, KL 0.1, entropy 0.01) with
    these micro-batch options, holding the weights ``state`` of a reference actor; with ``state`` None it is the
    reference. Returns the actor and the reference's weights."""
    from megatron_agentrl.config import LossConfig, TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor

    tcfg = TrainConfig(micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                       sequence_packing=sequence_packing, recompute=recompute)
    torch.manual_seed(11)
    actor = MegatronActor(cfg, tcfg, LossConfig(tis_cap=2.0, kl_coef=0.1, entropy_coef=0.01))
    if state is None:
        return actor, actor.export_hf_state_dict()
    actor.load_hf_state_dict(state)
    return actor, state


def megatron_logits(model, tokens: torch.Tensor, vocab: int, hidden: int) -> torch.Tensor | None:
    """Full-vocab logits ``[B, S, vocab]`` of a megatron ``GPTModel`` stage at the current TP x PP
    (activations passed between PP stages with send/recv; the vocab-parallel output gathered
    over TP, padding removed). Returned on the last PP stage, None elsewhere. Collective."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    B, S = tokens.shape
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            h = torch.empty(S, B, hidden)
            dist.recv(h, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(h)
        out = model(tokens, pos, None)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out[..., :vocab].clone()


def ragged_batch(vocab: int, lengths: list[int], starts: list[int], seed: int, ref: bool = False,
                 lag: bool = False):
    """A GRPO ``TrainBatch`` of right-padded rows: row ``i`` has ``lengths[i]`` tokens, policy tokens from
    ``starts[i]`` on (the loss mask), random behavior log-probs and one advantage per row; with ``ref``
    reference log-probs, with ``lag`` version lags (-1 outside the mask). Width: the longest row."""
    from megatron_agentrl.megatron.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    tokens = torch.randint(1, vocab, (B, T), generator=g)
    n, s = torch.tensor(lengths), torch.tensor(starts)
    pos = torch.arange(T)[None]
    mask = ((pos >= s[:, None]) & (pos < n[:, None])).float()
    tokens = tokens * (pos < n[:, None])
    behavior = -torch.rand(B, T, generator=g) * mask * 6
    adv = torch.randn(B, 1, generator=g) * mask
    extra = []
    if ref or lag:
        extra.append(-torch.rand(B, T, generator=g) * mask * 6 if ref else None)
    if lag:
        extra.append(torch.where(mask > 0, torch.randint(0, 3, (B, T), generator=g), torch.full((B, T), -1)))
    return TrainBatch(tokens, mask, behavior, adv, *extra)


def tiny_agent_checkpoint(path: Path) -> Path:
    """A random tiny Qwen2 checkpoint (hidden 32, 2 layers, seed 0) with the demo tokenizer's vocab, written to
    ``path``: what an engine process serves before the trainer's first sync."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout_sglang.tokenizer import load_tokenizer

    tok = load_tokenizer(str(Path(__file__).resolve().parents[2] / "examples/tokenizer/tiny_agent"))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path
