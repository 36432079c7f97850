"""Memory plan of a run: what one GPU holds for a TP/PP/CP/EP train pool and the rollout pool.

Works from the Hugging Face config numbers alone (sizes, heads, vocab, experts), so a cluster layout
can be checked on a laptop before any weights are downloaded::

    hf = json.load(open("GLM-4-9B-0414/config.json"))
    plan = estimate_memory(hf, cfg)          # cfg: the run's Config
    print(format_plan(plan))

The estimate is rough by design and errs high:

* **train pool** (per GPU, the largest pipeline stage): weights in ``model.dtype``; gradients in
  fp32 (the actor's DDP buffer reduces in fp32); fp32 master weights when the compute dtype is not
  fp32 and Adam's two fp32 moments, both divided by DP x CP under
  ``train.use_distributed_optimizer`` (megatron shards them over the DP and CP ranks); activations
  of one micro-batch (``train.micro_batch_size`` sequences of ``rollout.max_total_tokens``, or the
  ``train.micro_batch_tokens`` budget when set), per layer and token of a dense layer (flash-attention,
  no recomputation; Korthikanti et al., 2022, with the SwiGLU MLP of FFN width ``f``)::

      (18 * h + 6 * f) / tp            with sequence parallelism (the trainer runs it under TP)
      10 * h + (8 * h + 6 * f) / tp    without (a dense LoRA run at TP > 1)

  bytes (2-byte values): attention ``11 h`` and norms ``4 h`` as in the paper, and the MLP's input ``2 h``, its
  ``[gate; up]`` output ``4 f``, SwiGLU output ``2 f`` and dropout mask ``h``; the paper's ``34 h`` is the case
  ``f = 4 h`` with a GeLU MLP (``19 h``), and megatron's own estimate (Megatron-LM
  ``theoretical_memory_usage.py``: ``18 + 4 f / h`` per ``h``, with sequence parallelism) counts the SwiGLU
  ``[gate; up]`` output once, so this one is the higher. Without sequence parallelism, the norms, the attention and
  MLP inputs and the dropout masks (``10 h``) stay whole on every TP rank. This per-layer figure is multiplied by
  the micro-batches 1F1B keeps in flight on the first stage, plus the fp32 logits of the last stage; context parallelism
  (``parallel.cp``) divides the tokens of each micro-batch, hence activations and logits, by ``cp``.
  ``train.recompute=full`` keeps only each recomputed layer's input (``tokens * h`` values) plus one layer's activations
  while it is recomputed; ``selective`` recomputes the core attention, whose ``[s, s]`` scores a
  flash kernel never stores, so it changes nothing in this estimate.
* **mixture-of-experts layers** (the model's MoE facts come from its weight mapping,
  :func:`megatron_agentrl.convert.get_mapping`: ``E`` experts of FFN width ``f``, top ``k`` per
  token, a shared expert of width ``s``, and which layers are MoE; GLM-4.5's first layers stay
  dense and count as above). Parameters of a MoE layer: attention and norms as a dense layer's,
  split over TP; the router ``E * h``, replicated over TP; the experts ``E * 3 * h * f``, split over
  ``parallel.ep`` and *not* over TP (expert tensor parallel 1); the shared expert ``3 * h * s``,
  split over TP. Under the distributed optimizer the fp32 master weights and Adam moments of the
  experts shard over the expert-data-parallel size ``train ranks / (ep * pp)`` (with expert TP 1;
  CP ranks count in it), the others over DP x CP; gradients are not sharded. With layers of both
  kinds the stages differ: the plan takes the stage with the most weights and optimizer state, and
  the activations of the stage that keeps the most. Activations of a MoE layer, bytes per token of a
  micro-batch (on a CP rank; 2-byte values, scaled to ``model.dtype`` like the dense formula, the
  router's in fp32), in place of the dense ``34 * h / tp``::

      ((15 * h + 8 * s) + 12 * E + c * k * (4 * h + 8 * f)) / tp

  ``15 * h``: Korthikanti's attention (``11 h``) and norms (``4 h``) without the dense MLP's
  ``19 h``; ``8 * s``: the shared expert's ``[gate; up]``, SwiGLU output and product; ``12 * E``:
  fp32 router logits, scores and routing map; each of the ``k`` routed copies of a token keeps its
  dispatched input and weighted output (``2 x 2 h``) and its expert's ``[gate; up]``, SwiGLU output
  and product (``8 f``). All of it is divided by TP: under TP the actor runs MoE models with
  sequence parallelism, so every TP rank routes its ``1 / tp`` of the micro-batch's tokens. ``c`` is
  ``train.moe_capacity_factor`` (an upper bound on an expert's share) or 1 without token dropping,
  i.e. even routing; a dropless router that piles tokens onto one rank's experts holds more.
* **rollout pool** (per GPU of one engine of ``ray.rollout_gpus_per_engine`` GPUs): weights in
  ``model.dtype`` split by the engine's TP, and the KV cache of the sequences one engine serves
  at once: ``2 * layers * kv_heads * head_dim * bytes`` per token, KV heads split by TP (replicated
  when TP exceeds them). Engines serve a MoE model with tensor parallelism only (SGLang
  ``--tp-size``, no expert parallelism): each engine GPU holds ``1 / tp`` of *all* experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from megatron_agentrl.config import Config, ConfigError
from megatron_agentrl.parallel_layout import ModelDims, uses_sequence_parallel
from rollout_sglang.engines.sglang_server_args import server_arg

GiB = 1024**3

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: CUDA context, NCCL buffers, allocator fragmentation: reserved on every GPU.
RUNTIME_OVERHEAD_GIB = 4.0


def _mapping_facts(hf: dict[str, Any]) -> Any | None:
    """The weight mapping of ``hf``'s family (the authority on its MoE layout), or None for a
    ``model_type`` without one; ConfigError names a field the family needs and ``hf`` lacks."""
    from megatron_agentrl.convert import MODEL_TYPES

    if hf.get("model_type") not in MODEL_TYPES:
        return None
    from megatron_agentrl.convert import get_mapping

    try:
        return get_mapping(SimpleNamespace(**hf))
    except AttributeError as e:
        raise ConfigError(f"the {hf.get('model_type')} model config lacks {e.name or e}; give the model's "
                          "Hugging Face config.json (model.hf_config or model.arch)") from None


@dataclass
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on (dense or mixture-of-experts)."""

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
    #: routed experts per MoE layer (0: a dense model), their FFN width, experts per token
    num_experts: int = 0
    moe_intermediate_size: int = 0
    experts_per_token: int = 0
    #: FFN width of the shared expert of each MoE layer (0: none)
    shared_expert_size: int = 0
    #: per layer, whether its MLP is a MoE layer (empty: all dense)
    moe_layers: tuple[bool, ...] = ()

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
        shape = cls(
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
        mapping = _mapping_facts(hf)
        if mapping is not None and mapping.is_moe:
            # MoE families: the mapping knows their attention flags and which layers hold experts
            shape.qkv_bias, shape.qk_norms = bool(mapping.qkv_bias), bool(mapping.qk_norms)
            shape.norms_per_layer = 4 if mapping.post_norms else 2
            shape.num_experts = int(mapping.num_experts)
            shape.moe_intermediate_size = int(mapping.moe_intermediate_size)
            shape.shared_expert_size = int(mapping.shared_expert_size)
            shape.moe_layers = tuple(bool(x) for x in mapping.moe_layers)
            topk = hf.get("num_experts_per_tok")
            if not isinstance(topk, int) or not 1 <= topk <= shape.num_experts:
                raise ConfigError(f"the {model_type} model config has num_experts_per_tok={topk!r}; it must be the "
                                  f"experts each token is routed to, in [1, {shape.num_experts}]")
            shape.experts_per_token = topk
        return shape

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture-of-experts layer."""
        return any(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) holds experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def attention_params(self) -> int:
        """Attention and norms of one decoder layer (every layer has them)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + self.norms_per_layer * h + (2 * self.head_dim if self.qk_norms else 0)

    def router_params(self) -> int:
        """The router of one MoE layer (replicated over TP)."""
        return self.num_experts * self.hidden_size

    def expert_params(self) -> int:
        """All routed experts of one MoE layer (gated MLPs of ``moe_intermediate_size``; split over EP)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def lora_params(self, layer: int, modules: list[str], rank: int) -> int:
        """Adapter parameters of layer ``layer`` at ``rank`` on the megatron ``modules`` adapted
        (``LoraOptions.megatron_modules``): ``rank x (in + out)`` each; a MoE layer's MLP has none (experts are
        not adapted)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ffn = 0 if self.is_moe_layer(layer) else self.intermediate_size
        sizes = {"self_attention.linear_qkv": h + q + 2 * kv, "self_attention.linear_proj": q + h,
                 "mlp.linear_fc1": (h + 2 * ffn) if ffn else 0, "mlp.linear_fc2": (ffn + h) if ffn else 0}
        return rank * sum(sizes[m] for m in modules)

    def tp_mlp_params(self, layer: int) -> int:
        """The MLP parameters of layer ``layer`` that TP splits: the dense MLP, or a MoE layer's shared expert."""
        if self.is_moe_layer(layer):
            return 3 * self.hidden_size * self.shared_expert_size
        return 3 * self.hidden_size * self.intermediate_size

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of decoder layer ``layer`` (attention, MLP or router + all experts + shared expert, norms)."""
        moe = self.router_params() + self.expert_params() if self.is_moe_layer(layer) else 0
        return self.attention_params() + self.tp_mlp_params(layer) + moe

    def embedding_params(self) -> int:
        """Input embedding (the output layer is as large unless tied)."""
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """All parameters of the model."""
        head = 0 if self.tied_embeddings else self.embedding_params()
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return layers + self.embedding_params() + head + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to."""
        unused = self.expert_params() * (self.num_experts - self.experts_per_token) // max(1, self.num_experts)
        return self.total_params() - unused * sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes of one token over all layers (whole model, before any TP split)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, layer: int, tp: int, dtype_bytes: int, capacity_factor: float,
                                   sequence_parallel: bool = True) -> float:
        """Activation bytes one token of a micro-batch leaves on a GPU in layer ``layer`` (module docstring);
        ``sequence_parallel``: whether the trainer runs it (a MoE layer under TP always does)."""
        h, f, scale = self.hidden_size, self.intermediate_size, dtype_bytes / 2  # the formulas count 2-byte values
        if not self.is_moe_layer(layer):
            if sequence_parallel or tp == 1:
                return (18 * h + 6 * f) * scale / tp
            return (10 * h + (8 * h + 6 * f) / tp) * scale
        routed = capacity_factor * self.experts_per_token * (4 * h + 8 * self.moe_intermediate_size)
        # sequence parallelism (MoE under TP): each TP rank holds 1 / tp of the tokens
        return ((15 * h + 8 * self.shared_expert_size) * scale + 12 * self.num_experts + routed * scale) / tp


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
    #: parameters a token passes through (== params_billion for a dense model)
    active_params_billion: float | None = None
    #: the rollout engines' own limits that the plan exceeds (SGLang's ``mem_fraction_static``), with the fix
    engine_problems: list[str] = field(default_factory=list)

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
            # experts: ep and pp split their weights and gradients, but their master weights and Adam moments
            # shard over the expert-DP ranks, train ranks / (ep x pp): per GPU only more ranks shrink those
            split = ("raise parallel.ep or parallel.pp, add train ranks (ray.train_workers: the experts' optimizer "
                     "state shards over all of them), raise parallel.cp (long sequences)" if self.layout.get("experts")
                     else "raise parallel.tp, parallel.pp or parallel.cp (long sequences)")
            out.append(f"train pool needs ~{self.train_total_gib:.1f} GiB per GPU, more than "
                       f"{self.gpu_memory_gib:.0f} GiB: {split}, set train.recompute=full, "
                       "or lower train.micro_batch_size / train.micro_batch_tokens / rollout.max_total_tokens")
        if self.rollout and self.rollout_total_gib > self.gpu_memory_gib:
            out.append(f"rollout engines need ~{self.rollout_total_gib:.1f} GiB per GPU, more than "
                       f"{self.gpu_memory_gib:.0f} GiB: raise ray.rollout_gpus_per_engine, or lower the sequences "
                       "in flight per engine")
        return out + self.engine_problems

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
    layout = cfg.parallel
    tp, pp, cp, ep = layout.tp, layout.pp, layout.cp, layout.ep
    layout.check_model(ModelDims.of(shape))
    wbytes = _DTYPE_BYTES[cfg.model.dtype]
    train_workers = cfg.ray.train_workers or layout.model_parallel_size
    layout.check_world(train_workers, "ray.train_workers")
    dp = train_workers // (tp * pp * cp)
    expert_dp = train_workers // (ep * pp)  # expert tensor parallel 1: the experts' data-parallel ranks

    # Per stage: its layers plus the embedding (first stage) or the output layer (last stage); with
    # pp == 1 the one stage holds both. Params a GPU holds: TP-split, replicated (router), EP-split (experts).
    layers_per_stage = layout.stage_layers(shape.num_layers)
    emb = shape.embedding_params()
    masters = 0 if wbytes == 4 else 4
    shards = max(1, dp) * cp if cfg.train.use_distributed_optimizer else 1
    expert_shards = max(1, expert_dp) if cfg.train.use_distributed_optimizer else 1
    stages = []
    for s in range(pp):
        layers = range(s * layers_per_stage, (s + 1) * layers_per_stage)
        extra = emb if s == 0 else 0
        if s == pp - 1 and (pp > 1 or not shape.tied_embeddings):
            extra += emb  # the output layer (a PP > 1 last stage keeps its own copy of a tied embedding)
        moe = [i for i in layers if shape.is_moe_layer(i)]
        dense = (sum(shape.attention_params() + shape.tp_mlp_params(i) for i in layers) + extra) / tp
        dense += len(moe) * shape.router_params()
        experts = len(moe) * shape.expert_params() / ep
        state = {
            "weights": (dense + experts) * wbytes / GiB,
            "grads_fp32": (dense + experts) * 4 / GiB,
            "master_weights_fp32": (dense / shards + experts / expert_shards) * masters / GiB,
            "adam_states_fp32": (dense / shards + experts / expert_shards) * 8 / GiB,
        }
        if cfg.lora.enabled:  # the base frozen: gradients and optimizer state of the adapters alone
            adapters = sum(shape.lora_params(i, cfg.lora.megatron_modules(), cfg.lora.rank) for i in layers) / tp
            state.update(weights=state["weights"] + adapters * wbytes / GiB, grads_fp32=adapters * 4 / GiB,
                         master_weights_fp32=adapters / shards * masters / GiB,
                         adam_states_fp32=adapters / shards * 8 / GiB)
        stages.append((sum(state.values()), s, layers, state))
    _, _, _, train = max(stages, key=lambda x: (x[0], -x[1]))  # the largest stage (the first of equals)
    seq = cfg.rollout.max_total_tokens
    samples = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    budget = cfg.train.micro_batch_tokens  # token-budget packing (0 = micro_batch_size rows)
    mb_tokens = max(budget, seq) if budget else seq * cfg.train.micro_batch_size
    micro_batches = max(1, math.ceil(samples * seq / max(1, dp) / mb_tokens))
    in_flight = min(pp, micro_batches)
    local_tokens = mb_tokens / cp  # each CP rank holds 1 / cp of every sequence
    capacity = cfg.train.moe_capacity_factor or 1.0
    recompute = cfg.train.recompute
    activations = 0.0
    sp = uses_sequence_parallel(tp, shape.is_moe, cfg.lora.enabled)
    for _, _, layers, _ in stages:  # activations of the stage whose layers keep the most
        per_layer = [shape.activation_bytes_per_token(i, tp, wbytes, capacity, sp) * local_tokens for i in layers]
        if recompute == "full":
            # a recomputed layer keeps only its input; one layer's activations live while it is recomputed
            recomputed = cfg.train.recompute_num_layers or layers_per_stage
            kept = recomputed * local_tokens * shape.hidden_size * wbytes + sum(per_layer[recomputed:])
            stage_act = kept * in_flight + max(per_layer[:recomputed])
        else:
            # selective (the core attention) saves nothing here: a flash kernel keeps no [s, s] scores anyway
            stage_act = sum(per_layer) * in_flight
        activations = max(activations, stage_act / GiB)
    train["activations"] = activations
    train["logits_fp32"] = local_tokens * (shape.vocab_size / tp) * 4 * 2 / GiB  # logits + log-softmax
    train["runtime_overhead"] = RUNTIME_OVERHEAD_GIB

    rollout: dict[str, float] = {}
    engine_tp = cfg.ray.rollout_gpus_per_engine
    engines = cfg.rollout.engine_count(cfg.lora.enabled)
    notes = []
    static_problem = None
    if tp > 1:
        notes.append(f"sequence parallelism {'on' if sp else 'off (LoRA adapters take the whole sequence)'} under "
                     f"TP {tp}: dense-layer activations {'(18h + 6f)/tp' if sp else '10h + (8h + 6f)/tp'} bytes "
                     "per token")
    if engine_tp:
        kv_split = min(engine_tp, shape.num_kv_heads)
        kv_token = shape.kv_bytes_per_token(wbytes) / kv_split
        # Every sample of a step may be in flight at once, spread over the engines of the pool, unless SGLang's
        # max_running_requests holds an engine to fewer
        server = cfg.rollout.sglang_server_args
        seqs_per_engine = math.ceil(samples / engines)
        running = server_arg(server, "max_running_requests")
        if isinstance(running, int):
            seqs_per_engine = min(seqs_per_engine, running)
        rollout = {
            "weights": shape.total_params() * wbytes / engine_tp / GiB,
            "kv_cache": kv_token * seqs_per_engine * seq / GiB,
            "runtime_overhead": RUNTIME_OVERHEAD_GIB,
        }
        free = gpu_memory_gib - rollout["weights"] - RUNTIME_OVERHEAD_GIB
        notes.append(f"KV cache: {kv_token / 1024:.0f} KiB per token per GPU; {seqs_per_engine} sequences of "
                     f"{seq} tokens per engine; room for ~{max(0, free) * GiB / kv_token / 1e6:.2f}M tokens per GPU")
        fraction = server_arg(server, "mem_fraction_static")
        if isinstance(fraction, (int, float)):
            static = fraction * gpu_memory_gib
            need = rollout["weights"] + rollout["kv_cache"]
            notes.append(f"SGLang's mem_fraction_static={fraction:g}: {static:.1f} GiB per engine GPU for the weights "
                         f"and the KV cache, {need:.1f} GiB planned")
            if need > static:
                static_problem = (f"rollout engines: the weights and KV cache need ~{need:.1f} GiB per GPU, more than "
                                  f"rollout.sglang_server_args.mem_fraction_static={fraction:g} of "
                                  f"{gpu_memory_gib:.0f} GiB gives ({static:.1f}): raise it (SGLang needs the rest "
                                  "for activations and CUDA graphs), lower max_running_requests, or raise "
                                  "ray.rollout_gpus_per_engine")
        if shape.is_moe:
            notes.append(f"engines serve the MoE model with tensor parallelism only (SGLang --tp-size {engine_tp}, "
                         f"no expert parallelism): each engine GPU holds 1/{engine_tp} of all {shape.num_experts} "
                         "experts of every MoE layer")
    else:
        notes.append("no rollout pool (ray.rollout_gpus_per_engine=0): the engine runs inside trainer rank 0")
    if shape.is_moe:
        routing = (f"a capacity factor of {capacity:g} (train.moe_capacity_factor)" if cfg.train.moe_capacity_factor
                   else "even routing (dropless: a skewed router holds more)")
        notes.append(f"MoE activations assume {routing}; top-{shape.experts_per_token} of {shape.num_experts} "
                     "experts per token")
    layout = {
        "tp": tp, "pp": pp, "cp": cp, "dp": dp, "train_gpus": train_workers if cfg.ray.train_gpus_per_worker else 0,
        "train_workers": train_workers, "rollout_slots": cfg.rollout.slot_count(cfg.lora.enabled),
        "engines_per_slot": cfg.rollout.engines_per_slot, "gpus_per_engine": engine_tp,
        "rollout_gpus": engines * engine_tp, "micro_batches_per_step": micro_batches,
        "ep": ep, "expert_dp": expert_dp if shape.is_moe else 0, "experts": shape.num_experts if shape.is_moe else 0,
        "experts_per_rank": shape.num_experts // ep if shape.is_moe else 0,
        "experts_per_token": shape.experts_per_token,
    }
    plan = MemoryPlan(params_billion=shape.total_params() / 1e9, layout=layout, train=train, rollout=rollout,
                      gpu_memory_gib=gpu_memory_gib, notes=notes, active_params_billion=shape.active_params() / 1e9,
                      engine_problems=[static_problem] if static_problem else [])
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


def format_layout(layout: dict[str, Any], show_ep: bool = False) -> str:
    """The train pool's ranks as ``TP 2 x PP 1 x CP 1 x DP 4``, then its expert parallelism (always for a MoE
    model, ``EP 1`` for a dense one when ``show_ep``)."""
    text = f"TP {layout['tp']} x PP {layout['pp']} x CP {layout['cp']} x DP {layout['dp']}"
    if layout.get("experts"):
        text += (f", EP {layout['ep']} ({layout['experts_per_rank']} of {layout['experts']} experts per rank, "
                 f"expert DP {layout['expert_dp']})")
    elif show_ep:
        text += f", EP {layout['ep']}"
    return text


def format_plan(plan: MemoryPlan) -> str:
    """A few plain lines: layout, then GiB per GPU of each pool, then notes."""
    lay = plan.layout
    model = f"model: {plan.params_billion:.2f}B parameters"
    if lay.get("experts") and plan.active_params_billion is not None:
        model += (f" ({plan.active_params_billion:.2f}B active per token: top-{lay['experts_per_token']} of "
                  f"{lay['experts']} experts)")
    lines = [
        model,
        f"train pool: {lay['train_workers']} ranks = {format_layout(lay)}, "
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
