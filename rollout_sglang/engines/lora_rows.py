"""LoRA adapters on a Hugging Face model, applied per batch row without merging them into the base.

Several weight versions then share one copy of the base: each row of a batch names its adapter (or none), and
a forward hook on every adapted linear layer adds ``scaling * B (A x)`` to the output of the rows that use it,
as PEFT's unmerged forward does. Rows that leave the batch (finished sequences) leave the assignment too
(:meth:`AdapterRows.select`).
"""
from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rollout_sglang.engines.adapter import Adapter


class AdapterRows:
    """The adapters loaded on ``model`` and the assignment of batch rows to them (see the module doc).

    Not thread-safe: the engine loads, unloads and generates under one lock.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # adapter name -> (version, scaling, {module: (A, B)})
        self._loaded: dict[str, tuple[int, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._hooks: dict[str, Any] = {}
        # while a forward runs: adapter name -> row indices (a LongTensor) of the rows that use it
        self._groups: dict[str, torch.Tensor] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def names(self) -> list[str]:
        """The adapters loaded, by name."""
        return list(self._loaded)

    def version_of(self, name: str) -> int:
        """The weight version adapter ``name`` is."""
        return self._loaded[name][0]

    def add(self, adapter: Adapter) -> None:
        """Load ``adapter`` (cast to the model's device and dtype). ValueError naming a module the model lacks or a
        tensor whose shape does not fit it; loading a name twice is refused (unload it first)."""
        if adapter.name in self._loaded:
            raise ValueError(f"adapter {adapter.name!r} is loaded already; unload it first")
        modules = {}
        for module, (a, b) in adapter.modules().items():
            layer = self._linear.get(module)
            if layer is None:
                close = difflib.get_close_matches(module, list(self._linear), n=2)
                raise ValueError(f"adapter {adapter.name}: the model has no linear layer {module!r} (close: "
                                 f"{close or 'none'}); was the adapter trained on this model?")
            out_f, in_f = layer.weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter {adapter.name}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                 f"but the layer is [{out_f}, {in_f}]: A must be [r, {in_f}] and B [{out_f}, r]")
            w = layer.weight
            modules[module] = (a.detach().to(w.device, w.dtype), b.detach().to(w.device, w.dtype))
        self._loaded[adapter.name] = (int(adapter.version), adapter.scaling, modules)
        for module in modules:
            if module not in self._hooks:
                self._hooks[module] = self._linear[module].register_forward_hook(self._hook(module))

    def remove(self, name: str) -> None:
        """Unload adapter ``name``; KeyError naming the loaded ones when it is not."""
        if name not in self._loaded:
            raise KeyError(f"no adapter {name!r} is loaded (loaded: {self.names() or 'none'})")
        del self._loaded[name]
        used = {m for _, _, modules in self._loaded.values() for m in modules}
        for module in [m for m in self._hooks if m not in used]:
            self._hooks.pop(module).remove()

    def _hook(self, module: str) -> Any:
        def add_delta(_layer: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            for name, rows in self._groups.items():
                _, scaling, modules = self._loaded[name]
                pair = modules.get(module)
                if pair is None:
                    continue
                a, b = pair
                delta = (x.index_select(0, rows) @ a.T) @ b.T
                output = output.index_add(0, rows, delta, alpha=scaling)
            return output
        return add_delta

    @contextlib.contextmanager
    def assign(self, per_row: Sequence[str | None]) -> Iterator["AdapterRows"]:
        """Row ``i`` of the forwards inside the block uses adapter ``per_row[i]`` (None: the base alone); KeyError
        naming an adapter that is not loaded."""
        unknown = sorted({n for n in per_row if n is not None and n not in self._loaded})
        if unknown:
            raise KeyError(f"adapter {unknown[0]!r} is not loaded (loaded: {self.names() or 'none'})")
        self._set(list(per_row))
        try:
            yield self
        finally:
            self._groups = {}

    def select(self, per_row: Sequence[str | None]) -> None:
        """The rows left after some left the batch: ``per_row`` is the new assignment (a subset of the old, in
        the batch's new order)."""
        self._set(list(per_row))

    def _set(self, per_row: list[str | None]) -> None:
        device = next(self.model.parameters()).device
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(per_row):
            if name is not None:
                groups.setdefault(name, []).append(i)
        self._groups = {n: torch.tensor(rows, dtype=torch.long, device=device) for n, rows in groups.items()}
