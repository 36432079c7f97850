"""A LoRA run's checkpoint as a model: its base with the adapters merged in, for ``megatron-to-hf``.

A LoRA checkpoint (``step_<k>/``) holds the adapters (``<layer>.lora.lora_a.weight`` ``[layers, r, in]`` and
``lora_b`` ``[layers, out, r]``, global shapes in megatron's layout: a fused QKV's rows interleaved per group, a
gated ``linear_fc1``'s ``[gate; up]``) and no base weight; its ``meta.json`` names the base (the run's ``hf_base/``)
by path and sha256 and holds the adapters' options. :class:`MergedLoraSource` reads the base one megatron tensor at
a time, brings it into megatron's layout (the mapping's ``to_megatron``), adds ``(alpha / r) B A`` in fp32 and hands
it back in the base's dtype, with the trainer's own merge (``lora.adapters.merge``).
"""
from __future__ import annotations

import json

import torch
from torch import Tensor

from megatron_agentrl.convert.base import ConversionError, GPTMapping
from megatron_agentrl.convert.checkpoint import TRAINING_MODEL_DIR, DistCheckpointReader
from megatron_agentrl.convert.hf_to_megatron import check_hf_tensors
from megatron_agentrl.convert.safetensors_io import SafetensorsReader
from megatron_agentrl.lora.adapters import ADAPTER, is_adapter, merge
from megatron_agentrl.lora.checkpoint import BaseError, check_base
from megatron_agentrl.lora.options import LoraOptions


def adapter_key(key: str, part: str) -> str:
    """The checkpoint key of ``part`` (``lora_a`` / ``lora_b``) of the adapter on the layer whose weight is
    stored under ``key`` (``decoder.layers.self_attention.linear_qkv.weight``)."""
    return f"{key.removesuffix('.weight')}.{ADAPTER}.{part}.weight"


class MergedLoraSource:
    """The merged model of the LoRA checkpoint whose model folder ``reader`` reads (module doc).

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
        self.scaling = LoraOptions.from_saved(lora).scaling
        try:
            self.base = SafetensorsReader(check_base(base, step))
        except BaseError as e:
            raise ConversionError(str(e)) from None
        check_hf_tensors(self.base, mapping)
        self._check_adapters()

    def _check_adapters(self) -> None:
        stored = {k for k in self.reader.keys() if is_adapter(k)}
        known: set[str] = set()
        for mname in self.mapping.megatron_names():
            key, _, stack = self.mapping.checkpoint_key(mname)
            a, b = adapter_key(key, "lora_a"), adapter_key(key, "lora_b")
            if a not in stored:
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

    def dtype(self, mname: str) -> torch.dtype:
        """The stored dtype of ``mname``: its base's."""
        return self.base.info(self.mapping.hf_names(mname)[0]).dtype

    def read_group(self, group: list[str], dtype: torch.dtype | None) -> dict[str, Tensor]:
        """The megatron tensors of ``group`` (:meth:`read`), in ``dtype`` (None: the base's)."""
        return {m: self.read(m) if dtype is None else self.read(m).to(dtype) for m in group}

    def read(self, mname: str) -> Tensor:
        """The full (unpadded) megatron tensor ``mname`` with its adapter merged in, in the base's dtype."""
        weight = self.mapping.to_megatron(mname, {n: self.base.read(n) for n in self.mapping.hf_names(mname)})
        key, index, _ = self.mapping.checkpoint_key(mname)
        a_key = adapter_key(key, "lora_a")
        if a_key not in self.reader.tensors:
            return weight
        pieces = {}
        for part in ("lora_a", "lora_b"):
            k = adapter_key(key, part)
            shape = self.reader.shape(k)[len(index):]
            pieces[part] = (k, (*index, 0, 0), (*(1,) * len(index), *shape))
        ab = self.reader.read(pieces)
        a, b = (ab[p].reshape(ab[p].shape[len(index):]) for p in ("lora_a", "lora_b"))
        return merge(weight, a, b, self.scaling)
