"""Memory plan of a run: what one GPU holds for a TP/PP/CP train pool and the rollout pool.

Works from the Hugging Face config numbers alone (sizes, heads, vocab), so a cluster layout can be
checked on a laptop before any weights are downloaded::

    hf = json.load(open("GLM-4-9B-0414/config.json"))
    plan = estimate_memory(hf, cfg)          # cfg: the run's Config
    print(format_plan(plan))

The estimate is rough by design and errs high:

* **train pool** (per GPU, the largest pipeline stage): weights in ``model.dtype``; gradients in
  fp32 (the actor's DDP buffer reduces in fp32); fp32 master weights when the compute dtype is not
  fp32 and Adam's two fp32 moments, both divided by DP x CP under
  ``train.use_distributed_optimizer`` (megatron shards them over the DP and CP ranks); activations
  of one micro-batch (``train.micro_batch_size`` sequences of ``rollout.max_total_tokens``, or the
  ``train.micro_batch_tokens`` budget when set), ``34 * tokens * h / tp`` bytes per layer
  (flash-attention, no recomputation: Korthikanti et al., 2022) times the micro-batches 1F1B keeps
  in flight on the first stage, plus the fp32 logits of the last stage; context parallelism
  (``parallel.cp``) divides the tokens of each micro-batch, hence activations and logits, by ``cp``.
  ``train.recompute=full`` keeps only each recomputed layer's input (``tokens * h`` values) plus one layer's activations
  while it is recomputed; ``selective`` recomputes the core attention, whose ``[s, s]`` scores a
  flash kernel never stores, so it changes nothing in this estimate.
* **rollout pool** (per GPU of one engine of ``ray.rollout_gpus_per_engine`` GPUs): weights in
  ``model.dtype`` split by the engine's TP, and the KV cache of the sequences one engine serves
  at once: ``2 * layers * kv_heads * head_dim * bytes`` per token, KV heads split by TP (replicated
  when TP exceeds them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_agentrl.config import Config, ConfigError

GiB = 1024**3

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: CUDA context, NCCL buffers, allocator fragmentation: reserved on every GPU.
RUNTIME_OVERHEAD_GIB = 4.0


@dataclass
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    norms_per_layer: int
    qk_norms: bool = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelShape":
        """Read the shape from a Hugging Face ``config.json`` dict; ConfigError names a missing field."""
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in hf]
        if missing:
            raise ConfigError(f"the model config lacks {', '.join(missing)}; give a Hugging Face config.json of a "
                              "decoder-only model (model.hf_config or model.arch)")
        heads = int(hf["num_attention_heads"])
        model_type = str(hf.get("model_type", ""))
        return cls(
            model_type=model_type,
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            vocab_size=int(hf["vocab_size"]),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            norms_per_layer=4 if model_type == "glm4" else 2,  # GLM-4: extra norms after attention and MLP
            qk_norms=model_type == "qwen3",  # Qwen3: an RMSNorm over each head's query and key
        )

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, gated MLP, norms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + self.norms_per_layer * h + (2 * self.head_dim if self.qk_norms else 0)

    def embedding_params(self) -> int:
        """Input embedding (the output layer is as large unless tied)."""
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """All parameters of the model."""
        head = 0 if self.tied_embeddings else self.embedding_params()
        return self.num_layers * self.layer_params() + self.embedding_params() + head + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes of one token over all layers (whole model, before any TP split)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass
class MemoryPlan:
    """Per-GPU estimates in GiB, the layout they assume, and the verdict against ``gpu_memory_gib``."""

    params_billion: float
    layout: dict[str, Any]
    train: dict[str, float]
    rollout: dict[str, float]
    gpu_memory_gib: float
    notes: list[str] = field(default_factory=list)
    layout_problems: list[str] = field(default_factory=list)

    @property
    def train_total_gib(self) -> float:
        """Everything a train-pool GPU holds."""
        return sum(self.train.values())

    @property
    def rollout_total_gib(self) -> float:
        """Everything a rollout-pool GPU holds (0 without a rollout pool)."""
        return sum(self.rollout.values())

    def memory_problems(self) -> list[str]:
        """The pools that do not fit in ``gpu_memory_gib``, one sentence each with the fix."""
        out = []
        if self.train_total_gib > self.gpu_memory_gib:
            out.append(f"train pool needs ~{self.train_total_gib:.1f} GiB per GPU, more than "
                       f"{self.gpu_memory_gib:.0f} GiB: raise parallel.tp, parallel.pp or parallel.cp (long "
                       "sequences), set train.recompute=full, "
                       "or lower train.micro_batch_size / train.micro_batch_tokens / rollout.max_total_tokens")
        if self.rollout and self.rollout_total_gib > self.gpu_memory_gib:
            out.append(f"rollout engines need ~{self.rollout_total_gib:.1f} GiB per GPU, more than "
                       f"{self.gpu_memory_gib:.0f} GiB: raise ray.rollout_gpus_per_engine, or lower the sequences "
                       "in flight per engine")
        return out

    def problems(self) -> list[str]:
        """Everything that does not fit (pools vs allocation, then memory); empty when the layout fits."""
        return self.layout_problems + self.memory_problems()


def estimate_memory(hf: dict[str, Any], cfg: Config, *, gpu_memory_gib: float = 80.0,
                    total_gpus: int | None = None) -> MemoryPlan:
    """Per-GPU memory of the train pool and of the rollout pool for ``cfg``'s layout.

    hf: the model's Hugging Face config as a dict (``config.json``).
    cfg: the run config (parallel, train, rollout, ray sections and ``model.dtype``).
    gpu_memory_gib: memory of one GPU (80 for an H100 80GB).
    total_gpus: GPUs of the allocation (e.g. slurm nodes x GPUs per node) to check that the pools fit
        in it; None skips that check.
    """
    shape = ModelShape.from_hf(hf)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if shape.num_heads % tp or shape.num_kv_heads % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the model's {shape.num_heads} attention heads and "
                          f"{shape.num_kv_heads} KV heads (megatron splits both); choose a divisor of "
                          f"{shape.num_kv_heads}")
    if shape.num_layers % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide the model's {shape.num_layers} layers; choose a divisor")
    wbytes = _DTYPE_BYTES[cfg.model.dtype]
    cp = cfg.parallel.cp
    train_workers = cfg.ray.train_workers or tp * pp * cp
    dp = train_workers // (tp * pp * cp)

    # The largest stage: its layers plus the embedding (first stage) or the output layer (last stage);
    # with pp == 1 the one stage holds both.
    layers_per_stage = shape.num_layers // pp
    emb = shape.embedding_params()
    extra = emb + (0 if shape.tied_embeddings else emb) if pp == 1 else emb
    stage_params = (layers_per_stage * shape.layer_params() + extra) / tp
    masters = 0 if wbytes == 4 else 4
    shards = max(1, dp) * cp if cfg.train.use_distributed_optimizer else 1
    train = {
        "weights": stage_params * wbytes / GiB,
        "grads_fp32": stage_params * 4 / GiB,
        "master_weights_fp32": stage_params * masters / shards / GiB,
        "adam_states_fp32": stage_params * 8 / shards / GiB,
    }
    seq = cfg.rollout.max_total_tokens
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    budget = cfg.train.micro_batch_tokens  # token-budget packing (0 = micro_batch_size rows)
    mb_tokens = max(budget, seq) if budget else seq * cfg.train.micro_batch_size
    micro_batches = max(1, math.ceil(samples * seq / max(1, dp) / mb_tokens))
    in_flight = min(pp, micro_batches)
    local_tokens = mb_tokens / cp  # each CP rank holds 1 / cp of every sequence
    per_layer_act = 34 * local_tokens * shape.hidden_size * (wbytes / 2) / tp
    recompute = cfg.train.recompute
    if recompute == "full":
        # a recomputed layer keeps only its input; one layer's activations live while it is recomputed
        recomputed = cfg.train.recompute_num_layers or layers_per_stage
        kept = recomputed * local_tokens * shape.hidden_size * wbytes + (layers_per_stage - recomputed) * per_layer_act
        train["activations"] = (kept * in_flight + per_layer_act) / GiB
    else:
        # selective (the core attention) saves nothing here: a flash kernel keeps no [s, s] scores anyway
        train["activations"] = per_layer_act * layers_per_stage * in_flight / GiB
    train["logits_fp32"] = local_tokens * (shape.vocab_size / tp) * 4 * 2 / GiB  # logits + log-softmax
    train["runtime_overhead"] = RUNTIME_OVERHEAD_GIB

    rollout: dict[str, float] = {}
    engine_tp = cfg.ray.rollout_gpus_per_engine
    engines = cfg.rollout.max_versions * cfg.rollout.engines_per_slot
    notes = []
    if engine_tp:
        kv_split = min(engine_tp, shape.num_kv_heads)
        kv_token = shape.kv_bytes_per_token(wbytes) / kv_split
        # Every sample of a step may be in flight at once, spread over the engines of the pool.
        seqs_per_engine = math.ceil(samples / engines)
        rollout = {
            "weights": shape.total_params() * wbytes / engine_tp / GiB,
            "kv_cache": kv_token * seqs_per_engine * seq / GiB,
            "runtime_overhead": RUNTIME_OVERHEAD_GIB,
        }
        free = gpu_memory_gib - rollout["weights"] - RUNTIME_OVERHEAD_GIB
        notes.append(f"KV cache: {kv_token / 1024:.0f} KiB per token per GPU; {seqs_per_engine} sequences of "
                     f"{seq} tokens per engine; room for ~{max(0, free) * GiB / kv_token / 1e6:.2f}M tokens per GPU")
    else:
        notes.append("no rollout pool (ray.rollout_gpus_per_engine=0): the engine runs inside trainer rank 0")
    layout = {
        "tp": tp, "pp": pp, "cp": cp, "dp": dp, "train_gpus": train_workers if cfg.ray.train_gpus_per_worker else 0,
        "train_workers": train_workers, "rollout_slots": cfg.rollout.max_versions,
        "engines_per_slot": cfg.rollout.engines_per_slot, "gpus_per_engine": engine_tp,
        "rollout_gpus": engines * engine_tp, "micro_batches_per_step": micro_batches,
    }
    plan = MemoryPlan(params_billion=shape.total_params() / 1e9, layout=layout, train=train, rollout=rollout,
                      gpu_memory_gib=gpu_memory_gib, notes=notes)
    if total_gpus is not None:
        train_gpus = math.ceil(train_workers * cfg.ray.train_gpus_per_worker)
        need = train_gpus + engines * engine_tp
        plan.layout["total_gpus"] = total_gpus
        if need > total_gpus:
            plan.layout_problems.append(f"the pools need {need} GPUs (train {train_gpus}, rollout "
                                        f"{engines * engine_tp}) but the allocation has {total_gpus}: add nodes or "
                                        "shrink ray.train_workers / rollout.max_versions / rollout.engines_per_slot")
        elif need < total_gpus:
            plan.notes.append(f"{total_gpus - need} of {total_gpus} GPUs are left unused by the pools")
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """A few plain lines: layout, then GiB per GPU of each pool, then notes."""
    lay = plan.layout
    lines = [
        f"model: {plan.params_billion:.2f}B parameters",
        f"train pool: {lay['train_workers']} ranks = TP {lay['tp']} x PP {lay['pp']} x CP {lay['cp']} "
        f"x DP {lay['dp']}, "
        f"up to {lay['micro_batches_per_step']} micro-batches per step per DP rank",
        f"rollout pool: {lay['rollout_slots']} version slots x {lay['engines_per_slot']} engines x "
        f"{lay['gpus_per_engine']} GPUs = {lay['rollout_gpus']} GPUs",
        "train GPU   (GiB): " + ", ".join(f"{k} {v:.1f}" for k, v in plan.train.items())
        + f" | total {plan.train_total_gib:.1f} of {plan.gpu_memory_gib:.0f}",
    ]
    if plan.rollout:
        lines.append("rollout GPU (GiB): " + ", ".join(f"{k} {v:.1f}" for k, v in plan.rollout.items())
                     + f" | total {plan.rollout_total_gib:.1f} of {plan.gpu_memory_gib:.0f}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
