"""A LoRA run's checkpoint for ``megatron-to-hf``: its base with the adapters merged in, or its adapters alone in
PEFT's format.

A LoRA checkpoint (``step_<k>/``) holds the adapters (``<layer>.lora.lora_a.weight`` ``[layers, r, in]`` and
``lora_b`` ``[layers, out, r]``, global shapes in megatron's layout: a fused QKV's rows interleaved per group, a
gated ``linear_fc1``'s ``[gate; up]``) and no base weight; its ``meta.json`` names the base (the run's ``hf_base/``)
by path and sha256 and holds the adapters' options. :class:`LoraCheckpoint` checks both, then either reads the base
one megatron tensor at a time, brings it into megatron's layout (the mapping's ``to_megatron``) and adds
``(alpha / r) B A`` in fp32 with the trainer's own merge (``lora.adapters.merge``), handing it back in the base's
dtype; or (:meth:`LoraCheckpoint.peft_adapter`) splits each fused layer's ``B`` into the projections' rows under
PEFT's names, as the run's own ``adapter/`` export does (``lora.peft_format``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from megatron_agentrl.convert.base import ConversionError, GPTMapping
from megatron_agentrl.convert.checkpoint import TRAINING_MODEL_DIR, DistCheckpointReader
from megatron_agentrl.convert.hf_to_megatron import check_hf_tensors
from megatron_agentrl.convert.safetensors_io import SafetensorsReader
from megatron_agentrl.lora.adapters import ADAPTER, is_adapter, merge
from megatron_agentrl.lora.checkpoint import BaseError, check_base
from megatron_agentrl.lora.options import LoraOptions
from megatron_agentrl.lora.peft_format import adapter_config, peft_names
from rollout_sglang.engines.adapter import Adapter


def adapter_key(key: str, part: str) -> str:
    """The checkpoint key of ``part`` (``lora_a`` / ``lora_b``) of the adapter on the layer whose weight is
    stored under ``key`` (``decoder.layers.self_attention.linear_qkv.weight``)."""
    return f"{key.removesuffix('.weight')}.{ADAPTER}.{part}.weight"


class LoraCheckpoint:
    """The LoRA checkpoint whose model folder ``reader`` reads (module doc): a source of merged megatron tensors for
    the converter (:meth:`dtype`, :meth:`read_group`), or of its adapters in PEFT's format (:meth:`peft_adapter`).

    Raises ConversionError naming the checkpoint when its ``meta.json`` names no base or no adapters' options, when
    the base is missing or changed (its sha256 is recomputed), or when base or adapters do not fit ``mapping``.
    """

    def __init__(self, reader: DistCheckpointReader, mapping: GPTMapping) -> None:
        self.reader, self.mapping = reader, mapping
        step = reader.root.parent if reader.root.name == TRAINING_MODEL_DIR else reader.root
        meta_file = step / "meta.json"
        try:
            meta = json.loads(meta_file.read_text())
            lora, base = meta["lora"], meta["base"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"'{reader.root}' holds LoRA adapters, and its base and adapter options are named "
                                  f"in the checkpoint's meta.json ('{meta_file}'), which cannot be read ({e!r}); "
                                  "give the run's step_<k>/ folder as it was written") from None
        self.options = LoraOptions.from_saved(lora)
        try:
            self.base_dir = Path(check_base(base, step).path)
        except BaseError as e:
            raise ConversionError(str(e)) from None
        self.base = SafetensorsReader(self.base_dir)
        check_hf_tensors(self.base, mapping)
        #: the megatron names of the adapted layers' weights, in the mapping's order
        self.adapted = self._check_adapters()

    def _check_adapters(self) -> list[str]:
        stored = {k for k in self.reader.keys() if is_adapter(k)}
        known: set[str] = set()
        adapted = []
        for mname in self.mapping.megatron_names():
            key, _, stack = self.mapping.checkpoint_key(mname)
            a, b = adapter_key(key, "lora_a"), adapter_key(key, "lora_b")
            if a not in stored:
                continue
            adapted.append(mname)
            if a in known:  # a stacked key: its shapes were checked with its first layer
                continue
            known |= {a, b}
            out, inp = self.mapping.megatron_shape(mname)
            got_a, got_b = self.reader.shape(a), self.reader.shape(b) if b in stored else None
            r = got_a[-2]
            if got_a != (*stack, r, inp) or got_b != (*stack, out, r):
                raise ConversionError(f"'{self.reader.root}': the adapter of '{key}' has A {got_a} and B {got_b}; a "
                                      f"layer of [{out}, {inp}] needs A [{r}, {inp}] and B [{out}, {r}] per layer")
        if stored - known:
            raise ConversionError(f"'{self.reader.root}' holds adapters on no layer of this {self.mapping.model_type} "
                                  f"config: {sorted(stored - known)[:4]}; is the HF config the run's?")
        return adapted

    def dtype(self, mname: str) -> torch.dtype:
        """The stored dtype of ``mname``: its base's."""
        return self.base.info(self.mapping.hf_names(mname)[0]).dtype

    def read_group(self, group: list[str], dtype: torch.dtype | None) -> dict[str, Tensor]:
        """The merged megatron tensors of ``group`` (:meth:`read`), in ``dtype`` (None: the base's)."""
        return {m: self.read(m) if dtype is None else self.read(m).to(dtype) for m in group}

    def read(self, mname: str) -> Tensor:
        """The full (unpadded) megatron tensor ``mname`` with its adapter merged in, in the base's dtype."""
        weight = self.mapping.to_megatron(mname, {n: self.base.read(n) for n in self.mapping.hf_names(mname)})
        ab = self.adapter(mname)
        return weight if ab is None else merge(weight, *ab, self.options.scaling)

    def adapter(self, mname: str) -> tuple[Tensor, Tensor] | None:
        """``(A [r, in], B [out, r])`` of the adapter on the layer ``mname`` (B in megatron's layout, both as
        stored), None for a layer without one."""
        key, index, _ = self.mapping.checkpoint_key(mname)
        if adapter_key(key, "lora_a") not in self.reader.tensors:
            return None
        pieces = {}
        for part in ("lora_a", "lora_b"):
            k = adapter_key(key, part)
            shape = self.reader.shape(k)[len(index):]
            pieces[part] = (k, (*index, 0, 0), (*(1,) * len(index), *shape))
        ab = self.reader.read(pieces)
        a, b = (ab[p].reshape(ab[p].shape[len(index):]) for p in ("lora_a", "lora_b"))
        return a, b

    def peft_adapter(self, dtype: torch.dtype | None = None) -> Adapter:
        """The adapters in PEFT's format, as the run's ``adapter/`` export writes them (module doc), for the base
        folder this checkpoint names (its ``base_model_name_or_path``); in ``dtype`` (None: as stored)."""
        tensors: dict[str, Tensor] = {}
        for mname in self.adapted:
            a, b = self.adapter(mname)  # type: ignore[misc]  # every adapted layer has one
            if dtype is not None:
                a, b = a.to(dtype), b.to(dtype)
            for hf_weight, rows in self.mapping.to_hf(mname, b).items():
                a_name, b_name = peft_names(hf_weight)
                # a copy of A for each projection: safetensors stores no tensors that share memory
                tensors[a_name], tensors[b_name] = a.clone(), rows.contiguous()
        return Adapter(0, adapter_config(self.options, tensors, str(Path(self.base_dir).resolve())), tensors)
