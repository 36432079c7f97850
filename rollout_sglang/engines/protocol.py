"""The engine protocol that every rollout engine (local PyTorch, SGLang) implements.

Token ids in, token ids and their log-probs out. Log-probs are those of the distribution the
token was sampled from: ``log_softmax(logits / temperature)`` before top-p/top-k truncation.
Weights arrive as Hugging Face parameter names between ``begin_weight_update`` and
``end_weight_update``; the engine's ``version`` changes only when the update completes.
``score`` goes the other way: given whole token sequences, it returns each token's log-prob under the
engine's current weights, untempered (the teacher side of on-policy distillation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Protocol, runtime_checkable

import numpy as np
import torch


class EngineUnavailable(RuntimeError):
    """An engine could not serve a request for reasons of its own (unreachable, stalled, restarted, aborted
    the request): nothing is wrong with the request, so the version pool sends it to another engine."""


class EnginesUnavailable(TimeoutError):
    """No engine could serve for the pool's unavailable timeout: the message names each engine and why."""


@dataclass
class SamplingParams:
    """Sampling settings of one generate call.

    max_new_tokens: cap on generated tokens per sequence.
    temperature: softmax temperature; the reported log-probs use it (0 = greedy, log-probs then untempered).
    top_p, top_k: nucleus / top-k truncation (1.0 / -1 disable).
    stop_token_ids: generation of a sequence ends after emitting one of these (it is kept).
    seed: seeds the sampler for reproducible runs: row i of the batch samples from its own
        generator seeded ``seed + i`` (None: the engine's generator state); a call's ``seeds``
        (:meth:`Engine.generate`) name each row's seed instead.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


#: How an engine holds its running requests for a weight update that does not wait for them (:meth:`Engine.pause`):
#: "in_place" keeps each request and its KV cache, so it continues on the new weights over context the old weights
#: encoded (cheap, slightly off-policy); "retract" keeps each request and recomputes its KV cache with the new
#: weights before it continues (exact: every token after the update is sampled as the new weights alone would).
#: SGLang's ``/pause_generation`` modes of the same names.
PauseMode = Literal["in_place", "retract"]
PAUSE_MODES: tuple[str, ...] = ("in_place", "retract")


@dataclass
class GenerationOutput:
    """One sequence's result: generated ``token_ids``, their ``logprobs`` (same length),
    ``finish_reason`` ("stop" or "length"), the weight ``version`` that generated its last token, and
    ``token_versions``, the version that sampled each token (same length as ``token_ids``; a request that an
    in-flight weight update crossed holds two versions; when not given, every token is ``version``'s).

    routed_experts: when the call asked for routing (``routing_from``), the experts chosen for
        positions ``[routing_from, len(prompt) + len(token_ids) - 1)`` of prompt + generated tokens,
        ``[positions, MoE layers, top-k]`` (:mod:`rollout_sglang.routing`); None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    routed_experts: np.ndarray | None = None
    token_versions: list[int] = None  # type: ignore[assignment]  # filled from ``version`` when not given

    def __post_init__(self) -> None:
        if self.token_versions is None:
            self.token_versions = [int(self.version)] * len(self.token_ids)
        elif len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"token_versions has {len(self.token_versions)} entries for {len(self.token_ids)} "
                             "tokens; give one version per generated token")


def routing_starts(prompts: list[list[int]], routing_from: list[int]) -> list[int]:
    """``routing_from`` checked against ``prompts`` (:meth:`Engine.generate`): one start per prompt, each an int in
    ``[0, len(prompt)]`` (the range SGLang's scheduler accepts; it aborts a request outside it); ValueError naming
    the first that is not."""
    starts = list(routing_from)
    if len(starts) != len(prompts):
        raise ValueError(f"routing_from has {len(starts)} starts for {len(prompts)} prompts; give one per prompt")
    for i, (start, prompt) in enumerate(zip(starts, prompts)):
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= int(start) <= len(prompt):
            raise ValueError(f"routing_from[{i}]={start!r} must be an int in [0, {len(prompt)}] (the prompt's length)")
    return [int(start) for start in starts]


def check_score_inputs(sequences: list[list[int]], starts: list[int] | None = None,
                       vocab_size: int | None = None) -> tuple[list[list[int]], list[int]]:
    """``sequences`` and ``starts`` of :meth:`Engine.score` checked: ``(sequences as lists of int, one start per
    sequence)`` (``starts`` None: 0 each). ValueError naming the first of: a sequence that is empty or holds
    something other than an int token id, a negative id, an id ``>= vocab_size`` (when given), a ``starts`` of
    another length, a start that is not an int in ``[0, len(sequence)]``."""
    seqs: list[list[int]] = []
    for i, seq in enumerate(sequences):
        seq = list(seq)
        if not seq:
            raise ValueError(f"sequence {i} is empty; every scored sequence needs at least one token")
        bad = next((t for t in seq if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise ValueError(f"sequence {i} holds {bad!r}, not an int token id")
        lo, hi = min(seq), max(seq)
        if lo < 0:
            raise ValueError(f"sequence {i} has token id {lo}; token ids are >= 0")
        if vocab_size is not None and hi >= vocab_size:
            raise ValueError(f"sequence {i} has token id {hi} outside the model vocabulary [0, {vocab_size}); is the "
                             "tokenizer larger than the model's vocab_size?")
        seqs.append([int(t) for t in seq])
    if starts is None:
        return seqs, [0] * len(seqs)
    firsts = list(starts)
    if len(firsts) != len(seqs):
        raise ValueError(f"starts has {len(firsts)} entries for {len(seqs)} sequences; give one per sequence")
    for i, (start, seq) in enumerate(zip(firsts, seqs)):
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= int(start) <= len(seq):
            raise ValueError(f"starts[{i}]={start!r} must be an int in [0, {len(seq)}] (the sequence's length)")
    return seqs, [int(s) for s in firsts]


def check_adapters(prompts: list[list[int]], adapters: list[str | None] | None) -> list[str | None] | None:
    """``adapters`` (:meth:`Engine.generate`) checked against ``prompts``: None, or one name (or None) per prompt;
    ValueError naming what is wrong."""
    if adapters is None:
        return None
    names = list(adapters)
    if len(names) != len(prompts):
        raise ValueError(f"adapters has {len(names)} names for {len(prompts)} prompts; give one per prompt (None: "
                         "the base)")
    bad = [n for n in names if n is not None and not (isinstance(n, str) and n)]
    if bad:
        raise ValueError(f"adapters names {bad[0]!r}: each must be an adapter's name or None")
    return names if any(n is not None for n in names) else None


def row_seeds(prompts: list[list[int]], params: SamplingParams, seeds: list[int | None] | None) -> list[int | None]:
    """The seed of each row of a :meth:`Engine.generate` call: ``seeds`` when given (one int or None per prompt),
    else ``params.seed + i`` for row ``i``, else None (the engine's own generator). ValueError naming a wrong count
    or a seed that is not an int in ``[0, 2**63)`` (SGLang's ``sampling_seed`` is an int64)."""
    if seeds is None:
        out: list = [None if params.seed is None else int(params.seed) + i for i in range(len(prompts))]
    else:
        out = list(seeds)
        if len(out) != len(prompts):
            raise ValueError(f"seeds has {len(out)} seeds for {len(prompts)} prompts; give one per prompt (None: "
                             "unseeded)")
    for i, s in enumerate(out):
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 1 << 63):
            what = f"seeds[{i}]={s!r}" if seeds is not None else f"seed={params.seed!r} (row {i}: {s!r})"
            raise ValueError(f"{what}: a row's seed must be an int in [0, 2**63) or None")
    return [None if s is None else int(s) for s in out]


@runtime_checkable
class Engine(Protocol):
    """What the agent loop and the weight sync need from an engine."""

    version: int

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       routing_from: list[int] | None = None,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """Continue each prompt (a list of token ids); one output per prompt, same order.

        Engines that serve LoRA adapters (:class:`AdapterEngine`) also take ``adapters``: one loaded adapter's
        name (or None: the base) per prompt; each output then carries its adapter's version.

        seeds: one seed (or None: unseeded) per prompt, which row ``i`` samples with in place of
            ``params.seed + i`` (:func:`row_seeds`): the version pool, which splits a call's rows among engines,
            names each row's seed in every seeded call, and a merging
            :class:`~rollout_sglang.engines.batching.BatchingEngine` in every merged call with a seeded row.
            None: as ``params.seed`` says.

        routing_from: MoE models: one start position per prompt; each output then carries the routed
            experts of positions ``[routing_from[i], end - 1)`` (a multi-turn episode asks only for the
            positions its earlier turns did not cover). None: no routing (engines that cannot capture it
            are only ever called without).
        """
        ...

    async def score(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        """Each token's log-prob given all tokens before it, under the engine's current weights (the base model:
        no adapter), untempered: ``log_softmax(logits)`` at temperature 1, as SGLang's
        ``meta_info.input_token_logprobs``. ``out[i]`` has ``len(sequences[i])`` floats; position 0 (nothing
        before it) and the positions before ``starts[i]`` are not scored and hold 0.0 (``starts`` None: every
        position from 1 on is scored; a start of ``len(sequences[i])`` scores none).

        Waits while the engine is paused, as :meth:`generate` does. ValueError (:func:`check_score_inputs`) for an
        empty sequence, an id outside the vocabulary (an engine that knows it; an SGLang server refuses it
        itself), a start outside ``[0, len(sequence)]``.
        """
        ...

    def pause(self, mode: PauseMode | None = None) -> None:
        """Stop generating for a weight update. ``mode`` None: stop admitting new requests (the version pool drained
        the engine first); ``"in_place"`` / ``"retract"`` (:data:`PauseMode`): hold the running requests between two
        tokens, to continue after :meth:`resume` on the weights loaded meanwhile."""
        ...

    def resume(self) -> None:
        """Admit generation again after :meth:`pause`."""
        ...

    def begin_weight_update(self, version: int, metadata: dict) -> None:
        """Start receiving weights for ``version``; ``metadata`` names dtypes/shapes when known.

        The one place an engine learns an update's version (the version pool calls it as it opens the
        update); the buckets that follow carry none.
        """
        ...

    def receive_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of (Hugging Face name, tensor) pairs."""
        ...

    def end_weight_update(self) -> None:
        """Finish the update: the engine now serves ``version``."""
        ...

    def health(self) -> dict:
        """A small status dict (``{"ok": bool, "version": int, ...}``)."""
        ...


@runtime_checkable
class AdapterEngine(Protocol):
    """What an engine adds to serve weight versions as LoRA adapters on its base (a LoRA run)."""

    def load_adapter(self, adapter: Any) -> None:
        """Load an :class:`~rollout_sglang.engines.adapter.Adapter` beside the others, under ``adapter.name``."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Unload the adapter called ``name``."""
        ...


@dataclass
class Probe:
    """The answer of an engine's health probe.

    ok: it served a probe generation in time. weight_version: the version its weights are stamped with
    as the engine itself reports it (None: unknown, e.g. a freshly started SGLang server, which must be
    given weights before it serves). error: why not ok.
    """

    ok: bool
    weight_version: int | None = None
    error: str = ""
