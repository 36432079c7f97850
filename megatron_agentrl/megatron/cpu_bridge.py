"""Bridge megatron-core's CUDA assumptions so that it runs on CPU with the gloo backend.

megatron-core (0.16) assumes a GPU in a handful of places that the trainer reaches even
when every tensor lives on the CPU. :func:`install` patches exactly those, in memory and
only in this process (the installed package is never modified), and only when
``torch.cuda.is_available()`` is False; on a CUDA machine it does nothing.

What is bridged, and which megatron function needs it:

1. ``torch.cuda.current_device()`` -> ``torch.device("cpu")``. Used as the ``device=`` of
   buffers by ``distributed.param_and_grad_buffer._ParamAndGradBuffer`` (the DDP grad
   buffer), ``pipeline_parallel.p2p_communication`` (shape/tensor receive buffers),
   ``tensor_parallel.mappings`` (all-gather outputs), ``GPTModel``/rotary embeddings.
2. ``torch.cuda.synchronize()`` -> no-op. Called by ``p2p_communication._communicate``
   after batched send/recv.
3. The RNG tracker. ``tensor_parallel.random.CudaRNGStatesTracker.add`` reads and seeds the
   CUDA generator, ``fork`` (entered by attention/embedding dropout and weight init) and
   activation checkpointing swap CUDA generator states through ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state``. On CPU the tracker forks the CPU default generator instead
   (:class:`CpuRNGStatesTracker`), so ``model_parallel_cuda_manual_seed`` works unchanged.
4. ``pipeline_parallel.schedules``: every schedule allocates its token counter with
   ``torch.zeros([], dtype=torch.int, device="cuda")``. The module's ``torch`` name is
   replaced by a thin proxy of ``torch`` whose ``zeros`` maps ``device="cuda"`` to the CPU
   (everything else is forwarded untouched).
5. ``LanguageModule.setup_embeddings_and_output_layer`` (run by ``GPTModel.__init__``) moves
   the tied word embedding with ``weight.data.cuda()`` before its first/last-stage
   all-reduce when PP > 1 and embeddings are tied; during that call only,
   ``Tensor.cuda`` returns the tensor itself.
6. ``fusions.fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax`` (the local-spec
   attention softmax) builds the causal mask with ``transformer.utils.get_default_causal_mask``,
   which allocates on ``device="cuda"``, whenever ``attention_mask`` is None; the name it
   imported is replaced by a CPU version (same values, cached per length).

The trainer does not use megatron's optimizer (``megatron.core.optimizer``), whose fp16/bf16
and clipping paths hard-code CUDA tensor types; see ``megatron_agentrl.megatron.actor``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_INSTALLED = False


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device()``: the device to allocate buffers on."""
    return torch.device("cpu")


def _noop_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize()``: CPU work is synchronous."""


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stand-in for ``tensor_parallel.random._get_cuda_rng_state``: the CPU generator state."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stand-in for ``tensor_parallel.random._set_cuda_rng_state``: set the CPU generator state."""
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Stand-in for ``transformer.utils.get_default_causal_mask``: ``[sq, sq]`` bool, True above the
    diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _CpuZerosTorch(types.ModuleType):
    """A proxy of the ``torch`` module whose ``zeros`` sends ``device="cuda"`` to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros`` with a CUDA ``device`` argument replaced by the CPU."""
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """Within the block, ``Tensor.cuda(...)`` returns the tensor itself (CPU stays CPU)."""
    orig = torch.Tensor.cuda

    def _identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = _identity  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = orig  # type: ignore[method-assign]


def _make_cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` whose named states are CPU generator states.

        ``add(name, seed)`` stores the state of a generator seeded with ``seed``; ``fork(name)``
        swaps it into the CPU default generator for the block and saves it back afterwards.
        """

        def add(self, name: str, seed: int) -> None:
            """Track a new named RNG state seeded with ``seed`` (names and seeds must be new)."""
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            """Run the block with the CPU generator in state ``name``; restore it afterwards."""
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def install() -> bool:
    """Install the CPU bridge (idempotent). Returns True when active, False on a CUDA machine.

    Call before building megatron models or running its schedules; ``initialize_parallel``
    calls it for you.
    """
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True

    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    # 1, 2: device queries and synchronization.
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _noop_synchronize  # type: ignore[assignment]

    # 3: RNG tracker and the rng-state helpers used by fork / activation checkpointing.
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    mrandom.CudaRNGStatesTracker = _make_cpu_tracker_class()
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom.CudaRNGStatesTracker
    ):
        mrandom.initialize_rng_tracker(force_reset=True)

    # 4: the schedules' device="cuda" token counter.
    schedules.torch = _CpuZerosTorch()  # type: ignore[attr-defined]

    # 5: Tensor.cuda() on the tied embedding in GPTModel.__init__ (PP > 1).
    cls = language_module.LanguageModule
    orig_setup = cls.setup_embeddings_and_output_layer

    @functools.wraps(orig_setup)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _tensor_cuda_is_identity():
            orig_setup(self)

    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer  # type: ignore[method-assign]

    # 6: the causal mask of the unfused attention softmax.
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

    _INSTALLED = True
    logger.debug("megatron-core CPU bridge installed")
    return True


def is_installed() -> bool:
    """Whether :func:`install` has patched this process."""
    return _INSTALLED
