"""Bridge megatron-core's CUDA assumptions so that it runs on CPU with the gloo backend.

megatron-core (0.16) assumes a GPU in a handful of places that the trainer reaches even
when every tensor lives on the CPU. :func:`install` patches exactly those, in memory and
only in this process (the installed package is never modified), and only when
``torch.cuda.is_available()`` is False; on a CUDA machine it does nothing (except the
torch-AdamW checkpoint fixes at the end of this list).

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
6. megatron's optimizer modules (``optimizer``, ``distrib_optimizer``, ``clip_grads``,
   ``grad_scaler``) allocate flags, scales and norms with ``device="cuda"``: their ``torch`` name
   is a proxy whose tensor factories send CUDA to the CPU. ``clip_grads``' fallback L2 norm
   (no apex / TE) is replaced by a CPU one.
7. The mixed-precision and distributed optimizers (``__init__``) and ``clip_grad_by_total_norm_fp32``
   sort or assert parameters by ``Tensor.type()`` names such as ``torch.cuda.FloatTensor``: within
   those calls a CPU float tensor reports its CUDA type name.
8. ``DistributedOptimizer.get_parameter_state_dp_zero`` (the gather behind the fully-reshardable
   checkpoint) moves shards with ``.cuda()``: within it, ``Tensor.cuda`` is the identity.
9. ``rope_utils.get_pos_emb_on_this_cp_rank`` (the rotary embedding's slice for this context-parallel
   rank, padded rows) builds its chunk index in pinned memory and moves it with ``.cuda()``:
   :func:`_cpu_pos_emb_on_this_cp_rank` selects the same chunks on the embedding's own device (also
   where ``rotary_pos_embedding`` and ``yarn_rotary_pos_embedding`` imported it by name).

10. The all-to-all token dispatcher of MoE layers (``MoEAlltoAllTokenDispatcher``) creates a
   ``torch.cuda.Stream`` for its device-to-host copies and moves its split sizes to the host only
   when they are CUDA tensors, so on the CPU they reach ``all_to_all_single`` as tensors, which
   it refuses: on CPU the class's stream is a placeholder and the split sizes become Python lists
   at the point where the CUDA path copies them to the host.

Without apex / TransformerEngine (on either device) two checkpoint-load paths of the distributed
optimizer mishandle torch AdamW's ``step``; :func:`_install_torch_adam_checkpoint_fixes` corrects
them, also on a CUDA machine. Likewise ``moe_utils`` refers to ``te_general_gemm`` (the router's
fp32 GEMM) without defining it when TransformerEngine is missing; it is set to None there, which
selects megatron's own ``torch.mm`` path.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
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


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Stand-in for ``rope_utils.get_pos_emb_on_this_cp_rank``: of ``pos_emb`` cut into ``2 * cp`` chunks
    along ``seq_dim``, chunks ``cp_rank`` and ``2 * cp - 1 - cp_rank`` (megatron's load-balanced
    context-parallel layout), with the index on ``pos_emb``'s device instead of pinned memory + CUDA."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor"})


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` (e.g. ``torch.zeros``) with a CUDA ``device`` argument replaced by the CPU."""

    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _CpuFactoryTorch(types.ModuleType):
    """A proxy of the ``torch`` module whose tensor factories (``zeros``, ``ones``, ``empty``,
    ``full``, ``tensor``) send ``device="cuda"`` to the CPU; every other name is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        return _cpu_factory(attr) if name in _FACTORIES else attr


def _cpu_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                 *args: Any) -> tuple[torch.Tensor, None]:
    """Stand-in for ``utils.local_multi_tensor_l2_norm`` (clip_grads' fallback without apex / TE): the
    L2 norm over every tensor of ``tensor_lists`` as a ``[1]`` fp32 CPU tensor."""
    norms = [torch.linalg.vector_norm(t.float()) for ts in tensor_lists for t in ts]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1), None


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _tensor_type_reads_as_cuda() -> Iterator[None]:
    """Within the block, ``Tensor.type()`` (no argument) names a CPU float tensor by its CUDA type:
    megatron's mixed-precision and distributed optimizers sort parameters by those names."""
    orig = torch.Tensor.type

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = orig(self, *args, **kwargs)
        if args or kwargs:
            return name
        return _CUDA_TYPE_NAMES.get(name, name)

    torch.Tensor.type = _type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = orig  # type: ignore[method-assign]


def _within(context: Callable[[], contextlib.AbstractContextManager[None]],
            fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside a fresh ``context()`` at every call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)

    return wrapper


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


_TORCH_ADAM_FIXED = False


def _install_torch_adam_checkpoint_fixes() -> None:
    """Where megatron-core runs without apex / TransformerEngine (on CPU, and on a GPU without TE), its
    distributed optimizer wraps ``torch.optim.AdamW``, whose per-parameter ``step`` two checkpoint-load
    paths of megatron 0.16 mishandle: ``load_state_dict`` gives every parameter the SAME step tensor
    (each optimizer step then advances it once per parameter), and the fully-reshardable load copies
    every state key including ``step``, which the checkpoint keeps apart (KeyError). Each parameter
    gets a step of its own after a load, and the per-parameter copy leaves ``step`` alone."""
    global _TORCH_ADAM_FIXED
    from megatron.core.optimizer import distrib_optimizer

    if _TORCH_ADAM_FIXED or distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    orig_set, orig_load = cls._set_main_param_and_optimizer_states, cls.load_state_dict

    @functools.wraps(orig_set)
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            orig_set(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    @functools.wraps(orig_load)
    def load_state_dict(self: Any, state_dict: Any) -> None:
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states  # type: ignore[method-assign]
    cls.load_state_dict = load_state_dict  # type: ignore[method-assign]
    _TORCH_ADAM_FIXED = True


def _install_moe_without_te() -> None:
    """``moe_utils.te_general_gemm`` is referenced but undefined without TransformerEngine."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _split_sizes_as_lists(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
    """CPU stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: where the CUDA path
    copies the split sizes to the host (``cuda_dtoh_point``), turn them into lists of ints."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attr in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, attr, None)
            if torch.is_tensor(value):
                setattr(self, attr, value.tolist())
    return tokens_per_expert


def _install_moe_dispatcher_bridge() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # never entered on CPU (see above)
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _split_sizes_as_lists  # type: ignore[method-assign]


def install() -> bool:
    """Install the CPU bridge (idempotent). Returns True when active, False on a CUDA machine.

    Call before building megatron models or running its schedules; ``initialize_parallel``
    calls it for you. The torch-AdamW checkpoint fixes (see
    :func:`_install_torch_adam_checkpoint_fixes`) are installed on either device.
    """
    global _INSTALLED
    _install_torch_adam_checkpoint_fixes()
    _install_moe_without_te()
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True

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
    schedules.torch = _CpuFactoryTorch()  # type: ignore[attr-defined]

    # 5: Tensor.cuda() on the tied embedding in GPTModel.__init__ (PP > 1).
    cls = language_module.LanguageModule
    cls.setup_embeddings_and_output_layer = _within(  # type: ignore[method-assign]
        _tensor_cuda_is_identity, cls.setup_embeddings_and_output_layer)

    # 6-8: megatron's optimizer (mixed precision, distributed optimizer, clipping, loss scaler).
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as moptimizer

    for module in (moptimizer, distrib_optimizer, clip_grads, grad_scaler):
        module.torch = _CpuFactoryTorch()  # type: ignore[attr-defined]
    clip_grads.l2_norm_impl = _cpu_l2_norm
    for cls_ in (moptimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls_.__init__ = _within(_tensor_type_reads_as_cuda, cls_.__init__)  # type: ignore[method-assign]
    dist_opt = distrib_optimizer.DistributedOptimizer
    # the shards it gathers for a checkpoint are already on the CPU
    dist_opt.get_parameter_state_dp_zero = _within(  # type: ignore[method-assign]
        _tensor_cuda_is_identity, dist_opt.get_parameter_state_dp_zero)
    clip_by_norm = _within(_tensor_type_reads_as_cuda, clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip_by_norm
    moptimizer.clip_grad_by_total_norm_fp32 = clip_by_norm  # imported by name there

    # 9: the rotary embedding's context-parallel slice (imported by name by the rotary modules).
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank  # type: ignore[attr-defined]

    # 10: the MoE all-to-all dispatcher's side stream and split sizes.
    _install_moe_dispatcher_bridge()

    _INSTALLED = True
    logger.debug("megatron-core CPU bridge installed")
    return True


def is_installed() -> bool:
    """Whether :func:`install` has patched this process."""
    return _INSTALLED
