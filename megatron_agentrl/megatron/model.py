"""Build a megatron-core ``GPTModel`` (one pipeline stage of it) from a Hugging Face config.

The model is built so that, with the same weights (see ``megatron_agentrl.convert``), its
logits equal ``transformers.Qwen2ForCausalLM``'s: RMSNorm, SwiGLU, QKV bias, grouped-query
attention, rotary embeddings with the config's theta, tied or untied embeddings, no dropout.
TransformerEngine layer specs are used when TransformerEngine imports, else megatron-core's
local specs (CPU). All CUDA-only fusions are turned off when CUDA is absent.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from megatron_agentrl.config import ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2",)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install
        return False
    return torch.cuda.is_available()


def rope_theta(hf_config: Any) -> float:
    """Rotary base of ``hf_config``: transformers 5 keeps it in ``rope_parameters["rope_theta"]``,
    older versions in ``rope_theta``. Raises ConfigError for rope scaling types other than default."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ConfigError(f"rope_type={rope_type!r} is not supported by the Megatron actor (only 'default' rotary)")
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) not in (None, "default"):
        raise ConfigError(f"rope_scaling={scaling!r} is not supported by the Megatron actor (only default rotary)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ConfigError("the HF config has no rope theta (rope_parameters['rope_theta'] or rope_theta)")
    return float(theta)


def make_transformer_config(hf_config: Any, dtype: torch.dtype = torch.float32) -> "Any":
    """A megatron ``TransformerConfig`` equivalent to the HF config, for the current TP/PP sizes.

    Requires ``initialize_parallel`` (reads TP/PP sizes from megatron's parallel_state).
    ``dtype`` is the parameter / compute dtype (float32, bfloat16 or float16). The residual
    stream stays in ``dtype`` (``fp32_residual_connection=False``), as in transformers/SGLang.
    ``calculate_per_token_loss=True``: losses are sums over tokens divided by the global token
    count in ``finalize_model_grads``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not supported by the Megatron actor; supported: {SUPPORTED_MODEL_TYPES}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act={act!r}: only silu (SwiGLU) is supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("use_sliding_window=True is not supported by the Megatron actor")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"dtype={dtype} must be float32, bfloat16 or float16")

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    n_layers = int(hf_config.num_hidden_layers)
    n_heads = int(hf_config.num_attention_heads)
    n_kv = int(getattr(hf_config, "num_key_value_heads", None) or n_heads)
    if n_layers % pp:
        raise ConfigError(f"num_hidden_layers={n_layers} is not divisible by parallel.pp={pp}")
    if n_heads % tp or n_kv % tp:
        raise ConfigError(
            f"num_attention_heads={n_heads} and num_key_value_heads={n_kv} must both be divisible by parallel.tp={tp}"
        )
    head_dim = getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // n_heads
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
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
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
    )


def build_gpt_model(
    hf_config: Any,
    pre_process: bool,
    post_process: bool,
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
) -> "Any":
    """The ``GPTModel`` chunk of this PP stage for ``hf_config`` (randomly initialised).

    Args:
        hf_config: a transformers ``PretrainedConfig`` (``model_type`` "qwen2").
        pre_process: this stage holds the embedding (first PP stage).
        post_process: this stage holds the final norm and output layer (last PP stage).
        dtype: parameter dtype.
        make_vocab_size_divisible_by: the vocab is padded to a multiple of this times TP.

    The output layer is vocab-parallel (``parallel_output=True``): without labels the model
    returns logits ``[B, S, padded_vocab / tp]``; padded vocab entries must be masked by the
    caller (see ``MegatronActor``). Requires ``initialize_parallel``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_agentrl.convert.qwen2 import padded_vocab_size

    config = make_transformer_config(hf_config, dtype)
    if _have_te():
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    theta = rope_theta(hf_config)
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
        rotary_percent=1.0,
        rotary_base=int(theta) if theta.is_integer() else theta,
    )
    # torch.nn.RMSNorm (local spec) is created in the default dtype; cast like megatron's Float16Module.
    if dtype != torch.float32:
        model.to(dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    logger.debug("built GPTModel stage pre=%s post=%s padded_vocab=%d spec=%s", pre_process, post_process,
                 vocab, "te" if _have_te() else "local")
    return model
