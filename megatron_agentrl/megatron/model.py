"""Build a megatron-core ``GPTModel`` (one pipeline stage of it) from a Hugging Face config.

The model is built so that, with the same weights (see ``megatron_agentrl.convert``), its
logits equal the ``transformers`` model's, for each supported family:

* ``qwen2`` (Qwen2 / Qwen2.5): RMSNorm, SwiGLU, QKV bias, grouped-query attention, rotary
  embeddings with the config's theta, tied or untied embeddings;
* ``qwen3`` (Qwen3 dense): no QKV bias (unless ``attention_bias``), an RMSNorm over each head's
  query and key before the rotary embedding (megatron-core's ``qk_layernorm``);
* ``llama``: the same as Qwen2 without biases; default or ``llama3`` rope scaling;
* ``glm4`` (GLM-4-0414): QKV bias (``attention_bias``), partial interleaved rotary
  (``partial_rotary_factor``; GLM rotates pairs ``(2i, 2i+1)``), and two extra RMSNorms per
  layer on the attention and MLP outputs before each residual add (:func:`glm4_layer_spec`,
  built from megatron-core's ``TransformerLayer`` and norm modules);
* ``qwen3_moe`` (Qwen3-MoE): Qwen3's attention, MoE MLPs (``moe.py``);
* ``glm4_moe`` (GLM-4.5): QKV bias, partial rotary of the first half of each head's dims
  (not interleaved), optional q/k norms (``use_qk_norm``), MoE MLPs with a shared expert and
  dense first layers (``moe.py``).

What differs between families (q/k/v bias, q/k norms, rotary layout, partial rotary, refusals, the router) is
declared by each family's module in ``megatron_agentrl.convert`` (``GPTMapping.transformer_options``,
``router_options``); :func:`make_transformer_config` asks the family and sets what is alike in all of them.

No dropout. TransformerEngine layer specs are used when TransformerEngine imports, else
megatron-core's local specs with our SDPA core attention (``attention.py``), which also takes packed
(THD) sequences. All CUDA-only fusions are turned off when CUDA is absent.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from megatron_agentrl.config import ConfigError, ParallelConfig, TrainConfig
from megatron_agentrl.convert import MODEL_TYPES as SUPPORTED_MODEL_TYPES
from megatron_agentrl.convert import get_mapping
from megatron_agentrl.megatron.moe import is_moe, moe_options
from megatron_agentrl.parallel_layout import ModelDims, uses_sequence_parallel

logger = logging.getLogger(__name__)

# Llama 3.x rope scaling as megatron-core implements it (RotaryEmbedding._apply_scaling):
# only ``factor`` is configurable, the rest is fixed.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def have_te() -> bool:
    """Transformer Engine imports and CUDA is present: the model is built with TE's layer specs."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return torch.cuda.is_available()


def _rope_params(hf_config: Any) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    return params


def rope_theta(hf_config: Any) -> float:
    """Rotary base of ``hf_config``: transformers 5 keeps it in ``rope_parameters["rope_theta"]``,
    older versions in ``rope_theta``. Raises ConfigError for rope types megatron cannot express
    (anything but ``default``, and ``llama3`` for Llama; see :func:`rope_scaling_factor`)."""
    rope_scaling_factor(hf_config)  # validates the rope type
    params = _rope_params(hf_config)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ConfigError("the HF config has no rope theta (rope_parameters['rope_theta'] or rope_theta)")
    return float(theta)


def rope_scaling_factor(hf_config: Any) -> float | None:
    """The Llama-3 rope scaling ``factor`` (``rope_type: llama3``), or None for plain rotary.

    megatron-core's Llama-3 scaling fixes ``low_freq_factor=1``, ``high_freq_factor=4`` and
    ``original_max_position_embeddings=8192`` (as every Llama 3.1 / 3.2 config has); other
    values, and other rope types (yarn, linear, dynamic, ...), raise ConfigError.
    """
    params = _rope_params(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return None
    model_type = getattr(hf_config, "model_type", None)
    if rope_type == "llama3" and model_type == "llama":
        bad = {k: params.get(k) for k, v in _LLAMA3_FIXED.items() if float(params.get(k, v)) != v}
        if bad:
            raise ConfigError(f"llama3 rope scaling with {bad} is not supported by megatron-core "
                              f"(it fixes {_LLAMA3_FIXED}; only 'factor' may vary)")
        return float(params.get("factor", 8.0))
    raise ConfigError(f"rope_type={rope_type!r} is not supported for model_type={model_type!r} "
                      "(supported: 'default', and 'llama3' for llama)")


def partial_rotary_factor(hf_config: Any) -> float:
    """Fraction of each head's dims that rotate (``partial_rotary_factor``; 1.0 when absent)."""
    params = _rope_params(hf_config)
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def recompute_options(train: TrainConfig, layers_per_stage: int) -> dict[str, Any]:
    """megatron-core's recomputation fields for ``train.recompute`` / ``train.recompute_num_layers``:
    "none" -> none; "selective" -> the core attention of every layer; "full" -> whole layers, the
    first ``recompute_num_layers`` of each stage (0 = all; :meth:`TrainConfig.check_recompute_layers`
    bounds it by ``layers_per_stage``)."""
    if train.recompute == "none":
        return {}
    if train.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {"recompute_granularity": "full", "recompute_method": "block",
            "recompute_num_layers": train.recompute_num_layers or layers_per_stage}


def make_transformer_config(hf_config: Any, dtype: torch.dtype = torch.float32, train: TrainConfig | None = None,
                            routing_replay: bool = False, lora: bool = False) -> "Any":
    """A megatron ``TransformerConfig`` equivalent to the HF config, for the current TP/PP/CP/EP sizes.

    Requires ``initialize_parallel`` (reads TP/PP/CP/EP sizes from megatron's parallel_state; the layout's
    rules against the model: :meth:`~megatron_agentrl.parallel_layout.ParallelLayout.check_model`).
    ``train`` (None: :class:`TrainConfig`'s defaults): ``recompute`` / ``recompute_num_layers``, activation
    recomputation (:func:`recompute_options`), and ``moe_aux_loss_coeff`` / ``moe_capacity_factor``, the MoE
    training settings of a MoE family (:func:`megatron_agentrl.megatron.moe.moe_options`). ``routing_replay``: a
    MoE model's routers get megatron's replay hook (``moe_enable_routing_replay``; driven by
    ``routing_replay.RoutingReplay``). ``lora``: the run trains adapters (sequence parallelism off for a dense
    model: :func:`~megatron_agentrl.parallel_layout.uses_sequence_parallel`).
    ``dtype`` is the parameter / compute dtype (float32, bfloat16 or float16). The residual
    stream stays in ``dtype`` (``fp32_residual_connection=False``), as in transformers/SGLang.
    ``calculate_per_token_loss=True``: losses are sums over tokens divided by the global token
    count in ``finalize_model_grads``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not supported by the Megatron actor; "
                          f"supported: {SUPPORTED_MODEL_TYPES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act={act!r}: only silu (SwiGLU) is supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("use_sliding_window=True is not supported by the Megatron actor")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype={dtype} must be float32, bfloat16 or float16")

    train = train if train is not None else TrainConfig()
    layout = ParallelConfig(tp=parallel_state.get_tensor_model_parallel_world_size(),
                            pp=parallel_state.get_pipeline_model_parallel_world_size(),
                            cp=parallel_state.get_context_parallel_world_size(),
                            ep=parallel_state.get_expert_model_parallel_world_size())
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    mapping = get_mapping(hf_config)
    layout.check_model(ModelDims.of(mapping))
    n_layers, n_heads, n_kv = mapping.num_layers, mapping.num_heads, mapping.num_kv_heads
    stage_layers = train.check_recompute_layers(n_layers, layout)
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // n_heads
    # the family's own fields (q/k/v bias, q/k norms, rotary layout), ConfigError for what it cannot express
    family = mapping.transformer_options(partial_rotary_factor(hf_config))
    moe = moe_options(hf_config, layout.ep, train.moe_aux_loss_coeff, train.moe_capacity_factor)
    cuda = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=n_layers,
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_attention_heads=n_heads,
        num_query_groups=n_kv,
        kv_channels=int(head_dim),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family["add_qkv_bias"],
        rotary_interleaved=family["rotary_interleaved"],
        qk_layernorm=family["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=uses_sequence_parallel(tp, bool(moe), lora),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        fp32_residual_connection=False,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        use_cpu_initialization=not cuda,
        # Fusions that need CUDA kernels (apex / megatron extensions) off.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=False,
        deallocate_pipeline_outputs=False,
        **recompute_options(train, stage_layers),
        **moe,
        **({"moe_enable_routing_replay": True} if moe and routing_replay else {}),
    )


class _NormedBDA:
    """A bias-dropout-add builder whose sublayer output is normalised first.

    ``TransformerLayer`` calls ``self.self_attn_bda(training, fused)(out_with_bias, residual,
    prob)`` (and the same for ``mlp_bda``); wrapping that builder gives GLM-4's
    ``residual + norm(sublayer(x))`` without overriding the layer's forward. The norm module is
    registered on the layer itself (this wrapper only refers to it).
    """

    def __init__(self, bda: Any, norm: torch.nn.Module) -> None:
        self._bda = bda
        self._norm = norm

    def __call__(self, training: bool, fused: bool) -> Any:
        inner = self._bda(training, fused)
        norm = self._norm

        def normed_bda(x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                       prob: float) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return inner((norm(x), None), residual, prob)

        return normed_bda


def _glm4_classes() -> tuple[type, type]:
    """(submodules dataclass, layer class) for GLM-4, built lazily so that importing this module
    does not import megatron-core."""
    global _GLM4_CLASSES
    if _GLM4_CLASSES is not None:
        return _GLM4_CLASSES
    from dataclasses import dataclass

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    @dataclass
    class Glm4TransformerLayerSubmodules(TransformerLayerSubmodules):
        """``TransformerLayerSubmodules`` plus GLM-4's norms on the attention and MLP outputs."""

        post_self_attn_layernorm: ModuleSpec | type = IdentityOp
        post_mlp_layernorm: ModuleSpec | type = IdentityOp

    class Glm4TransformerLayer(TransformerLayer):
        """megatron-core's ``TransformerLayer`` with GLM-4's sandwich norms:
        ``h = h + post_self_attn_layernorm(attn(input_layernorm(h)))``,
        ``h = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))``.

        Parameters ``post_self_attn_layernorm.weight`` and ``post_mlp_layernorm.weight`` (in the
        distributed checkpoint: ``decoder.layers.post_self_attn_layernorm.weight`` etc., stacked
        over layers and replicated over TP like the other norms).
        """

        def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, submodules, *args, **kwargs)
            norm_kwargs = {"config": self.config, "hidden_size": self.config.hidden_size,
                           "eps": self.config.layernorm_epsilon}
            self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_kwargs)
            self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_kwargs)
            self.self_attn_bda = _NormedBDA(self.self_attn_bda, self.post_self_attn_layernorm)
            self.mlp_bda = _NormedBDA(self.mlp_bda, self.post_mlp_layernorm)

    _GLM4_CLASSES = (Glm4TransformerLayerSubmodules, Glm4TransformerLayer)
    return _GLM4_CLASSES


_GLM4_CLASSES: tuple[type, type] | None = None


def glm4_layer_spec(base_spec: Any, use_te: bool) -> Any:
    """GLM-4's layer spec: ``base_spec`` (megatron-core's local or TE GPT layer spec) with the
    layer class swapped for ``Glm4TransformerLayer`` and two RMSNorms added after attention
    and after the MLP. The norm class is the base spec's input norm (local spec) or ``TENorm``
    (the TE spec fuses its input norms into the linear layers)."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    submodules_cls, layer_cls = _glm4_classes()
    base = base_spec.submodules
    norm = base.input_layernorm
    if use_te or norm is IdentityOp:
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return ModuleSpec(module=layer_cls, submodules=submodules_cls(
        **fields, post_self_attn_layernorm=norm, post_mlp_layernorm=norm))


def with_core_attention(spec: Any, core_attention: type) -> Any:
    """``spec`` (a GPT layer spec) with its self-attention's core attention replaced by ``core_attention``."""
    import dataclasses

    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def layer_spec(hf_config: Any, config: Any = None) -> Any:
    """The megatron-core transformer layer spec for ``hf_config``'s family: TransformerEngine's when it
    imports (with CUDA), else megatron-core's local spec with :class:`SDPACoreAttention` as its core
    attention (flash / memory-efficient SDPA kernels on GPU, packed THD sequences everywhere).

    A MoE family gets megatron's decoder block spec for this pipeline stage instead (dense and MoE
    layers as ``config.moe_layer_freq`` says; ``config``: its ``TransformerConfig``, required then).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_agentrl.megatron.attention import SDPACoreAttention
    from megatron_agentrl.megatron.norm import with_torch_norm

    use_te = have_te()
    model_type = getattr(hf_config, "model_type", None)
    if is_moe(hf_config):
        if config is None:
            raise ValueError(f"layer_spec of a {model_type} model needs its TransformerConfig")
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
        if not use_te:
            block.layer_specs = [with_core_attention(s, SDPACoreAttention) for s in block.layer_specs]
            block = with_torch_norm(block)  # a torch norm that works under sequence parallelism
        return block
    family = get_mapping(hf_config)
    qk_layernorm = family.qk_norms
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = with_core_attention(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm),
                                   SDPACoreAttention)
    if family.post_norms:
        spec = glm4_layer_spec(spec, use_te)
    if use_te:
        return spec
    # without TE: a block spec, so that the final norm is a torch norm as well (megatron's default for a layer spec
    # is WrappedTorchNorm, which refuses sequence parallelism)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_agentrl.megatron.norm import TorchNorm

    if config is None:
        raise ValueError(f"layer_spec of a {model_type} model without TransformerEngine needs its TransformerConfig")
    return with_torch_norm(TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                                      layer_norm=TorchNorm))


def build_gpt_model(
    hf_config: Any,
    pre_process: bool,
    post_process: bool,
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    train: TrainConfig | None = None,
    routing_replay: bool = False,
    lora: bool = False,
) -> "Any":
    """The ``GPTModel`` chunk of this PP stage for ``hf_config`` (randomly initialised).

    Args:
        hf_config: a transformers ``PretrainedConfig`` (``model_type`` in ``SUPPORTED_MODEL_TYPES``).
        pre_process: this stage holds the embedding (first PP stage).
        post_process: this stage holds the final norm and output layer (last PP stage).
        dtype: parameter dtype.
        make_vocab_size_divisible_by: the vocab is padded to a multiple of this times TP.
        train, routing_replay, lora: recomputation, MoE and sequence-parallel settings
            (:func:`make_transformer_config`).

    The output layer is vocab-parallel (``parallel_output=True``): without labels the model
    returns logits ``[B, S, padded_vocab / tp]``; padded vocab entries must be masked by the
    caller (see ``MegatronActor``). Requires ``initialize_parallel``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_agentrl.parallel_layout import padded_vocab_size

    config = make_transformer_config(hf_config, dtype, train, routing_replay, lora)
    spec = layer_spec(hf_config, config)
    theta = rope_theta(hf_config)
    scaling = rope_scaling_factor(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = padded_vocab_size(int(hf_config.vocab_size), make_vocab_size_divisible_by, tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=partial_rotary_factor(hf_config),
        rotary_base=int(theta) if theta.is_integer() else theta,
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling if scaling is not None else 8.0,
    )
    # torch.nn.RMSNorm (local spec) is created in the default dtype; cast like megatron's Float16Module.
    if dtype != torch.float32:
        model.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    logger.debug("built GPTModel stage pre=%s post=%s padded_vocab=%d spec=%s", pre_process, post_process,
                 vocab, "te" if have_te() else "local")
    return model
