"""The local PyTorch engine: a Hugging Face causal LM on CPU or one CUDA GPU, behind the Engine protocol.

It is the rollout engine of the CPU path (tests, CI, the demo) and a reference for the SGLang
engine's numerics. Generation is a hand-written KV-cache loop (not ``model.generate``):

* prompts are left-padded into one batch; ``attention_mask`` hides the pads and
  ``position_ids = cumsum(mask) - 1`` gives each row exactly the positions of an unpadded run;
* each step samples from ``softmax(logits / temperature)`` after top-k / top-p truncation and
  reports ``log_softmax(fp32 logits / temperature)[token]`` from *before* truncation;
* a seeded row (``params.seed + i`` for row ``i``, or the call's ``seeds[i]``) samples with its own
  ``torch.Generator``, so its tokens do not depend on the rest of the batch; unseeded rows share the engine's;
* rows stop on ``stop_token_ids`` (the stop token is kept) or at their call's ``max_new_tokens``; finished
  rows leave the batch (their KV cache rows are dropped);
* continuous batching: one decoding loop runs at a time, and a call that arrives while it runs with the same
  sampling settings (temperature, top-p, top-k, stop tokens) joins it at the next decode step: its
  prompts are prefilled and their KV cache merged into the batch's (both left-padded to the longer), and the call
  returns when its own rows are done; a call with other settings waits for the loop to end;
* LoRA adapters (:meth:`LocalEngine.load_adapter`) stay unmerged: each row of a call names its adapter or
  none (``adapters``), so every live weight version of a LoRA run shares this one base
  (:mod:`rollout_sglang.engines.lora_rows`); a row's output carries its adapter's version;
* MoE models, asked for routing (``routing_from``): hooks on the router modules
  (:mod:`rollout_sglang.engines.router_capture`) record each forward pass's top-k choices, and each
  row gets those of its positions ``[routing_from, len(prompt) + len(generated) - 1)``: the prefill's
  (its pads left out) and each decode step's (position ``t``: the forward of token ``t``; the last
  sampled token is never fed back). A dense model registers no hook.
* scoring (:meth:`LocalEngine.score`, the teacher side of on-policy distillation): whole sequences right-padded
  into one forward per chunk of at most :data:`SCORE_CHUNK_TOKENS` positions, each token's untempered
  ``log_softmax(fp32 logits)`` in the context before it, under the base model's weights.

Compute runs in a worker thread (``asyncio.to_thread``) under a lock that weight loading also takes, so weights
never change under a forward pass. Weights arrive by Hugging Face parameter name between
:meth:`LocalEngine.begin_weight_update` and :meth:`LocalEngine.end_weight_update`. A plain
:meth:`LocalEngine.pause` lets a running call finish (the version pool drained the engine first);
``pause("in_place")`` or ``pause("retract")`` (an in-flight update) holds a running call between two decode steps,
with the lock released so that the weights can load, and :meth:`LocalEngine.resume` continues it on them: over the
KV cache as it was (``in_place``), or after a forward of each row's prompt and tokens so far under the new weights
rebuilds the cache (``retract``; the routers' choices of that recompute are not recorded: a position keeps those of
the forward that sampled from it). Each output carries the version of every token (``token_versions``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.lora_rows import AdapterRows
from rollout_sglang.engines.protocol import (
    PAUSE_MODES,
    GenerationOutput,
    SamplingParams,
    check_adapters,
    check_score_inputs,
    routing_starts,
    row_seeds,
)
from rollout_sglang.engines.router_capture import RouterCapture, find_routers, routing_layout_of
from rollout_sglang.engines.wakeup import Wakeup
from rollout_sglang.routing import RoutingLayout
from rollout_sglang.weight_update.buckets import dtype_from_name

# One expert's weight as checkpoints (and SGLang) name it; transformers 5 holds a layer's experts fused
# in memory: ``experts.gate_up_proj [E, 2 * I, H]`` ([gate; up] per expert) and ``experts.down_proj [E, H, I]``.
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")

logger = logging.getLogger(__name__)

# the dtypes a model runs in (the wire names of weight_update.buckets, floating point only)
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: :meth:`LocalEngine.score` puts at most this many token positions (rows x the longest row, pads included) through
#: one forward; a sequence longer than this goes through a forward of its own
SCORE_CHUNK_TOKENS = 16384


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``torch.dtype`` from a dtype or its name ("float32", "bfloat16", "float16"; None -> float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        resolved = dtype_from_name(dtype)
    except ValueError:
        resolved = None
    if resolved not in _MODEL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of 'float32', 'bfloat16', 'float16'")
    return resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``torch.device`` for "cpu" or one CUDA GPU ("cuda", "cuda:0"); None picks CUDA when present."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported by LocalEngine; use 'cpu' or 'cuda[:N]'")
    return dev


def _truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. scaled: [B, V] float32."""
    vocab = scaled.shape[-1]
    out = scaled
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already cover top_p (the first is always kept)
        remove_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def _build_from_config(hf_config: Any, init_seed: int | None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(hf_config)``, seeded by ``init_seed`` when given."""
    from transformers import AutoModelForCausalLM, PreTrainedConfig

    if not isinstance(hf_config, PreTrainedConfig):
        raise TypeError(
            "LocalEngine needs a torch model, a transformers config or a checkpoint path; "
            f"got {type(hf_config).__name__}"
        )
    if init_seed is None:
        return AutoModelForCausalLM.from_config(hf_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(init_seed))
        return AutoModelForCausalLM.from_config(hf_config)


def _load_pretrained(path: str | os.PathLike, dtype: torch.dtype) -> torch.nn.Module:
    """Load a Hugging Face checkpoint directory offline; FileNotFoundError naming the path and the fix."""
    from transformers import AutoModelForCausalLM

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face checkpoint at {str(p)!r} (config.json missing); point the engine at a "
            "directory written by save_pretrained / the Megatron->HF converter (tools/), or build a "
            "random model with LocalEngine.from_config(hf_config)"
        )
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, local_files_only=True)


@dataclass(eq=False)
class _Row:
    """One prompt of a call in the decoding batch: what it generated so far and when it ends."""

    index: int  # its place in its call
    prompt: list[int]
    cap: int  # max_new_tokens
    stop: frozenset[int]
    adapter: str | None
    generator: torch.Generator | None  # its own, when the call is seeded
    routing_from: int | None  # MoE models: the first position whose routed experts it asked for
    record: list[torch.Tensor] = field(default_factory=list)  # those experts so far, [n, MoE layers, top-k] pieces
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str = "length"
    done: bool = False


@dataclass(eq=False)
class _Join:
    """A call that joins the running decoding loop: its rows and the future of its outputs."""

    rows: list[_Row]
    future: concurrent.futures.Future


def _merge_caches(cache: Any, mask: torch.Tensor, other: Any, other_mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``other``'s rows appended to ``cache`` (dynamic KV caches ``[b, heads, T, dim]`` per layer), both left-padded
    to the longer; the attention mask ``[b + b', T]`` hides the pads."""
    width = max(mask.shape[1], other_mask.shape[1])
    for layer, add in zip(cache.layers, other.layers):
        pad_a, pad_b = width - layer.keys.shape[-2], width - add.keys.shape[-2]
        layer.keys = torch.cat([F.pad(layer.keys, (0, 0, pad_a, 0)), F.pad(add.keys, (0, 0, pad_b, 0))])
        layer.values = torch.cat([F.pad(layer.values, (0, 0, pad_a, 0)), F.pad(add.values, (0, 0, pad_b, 0))])
    mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)), F.pad(other_mask, (width - other_mask.shape[1], 0))])
    return cache, mask


class LocalEngine:
    """A Hugging Face causal LM serving the Engine protocol in-process.

    model: what to serve, one of: a ``transformers`` causal LM module (e.g. ``Qwen2ForCausalLM``);
        a ``transformers`` config (a randomly initialised model is built from it, see ``init_seed``);
        or the path of a Hugging Face checkpoint directory (loaded offline). Moved to
        ``device``/``dtype`` and put in eval mode.
    device: "cpu", "cuda" or "cuda:N" (None: CUDA when available).
    dtype: parameter dtype ("float32", "bfloat16", "float16"); logits are cast to float32 for sampling.
    version: the weight version the engine starts with.
    seed: seeds the engine's own generator, used when ``SamplingParams.seed`` is None.
    resume_timeout_s: how long ``generate`` waits for :meth:`resume` while paused before raising
        TimeoutError.
    init_seed: with a config, makes the random initialisation reproducible (torch's global RNG
        is left unchanged); None draws from the global RNG.
    """

    #: a call that arrives while another decodes joins it between two decode steps (:class:`BatchingEngine` sends
    #: calls as they come)
    continuous_batching = True

    def __init__(
        self,
        model: "torch.nn.Module | Any | str | os.PathLike",
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = torch.float32,
        version: int = 0,
        seed: int = 0,
        resume_timeout_s: float = 600.0,
        init_seed: int | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            model = _load_pretrained(model, self.dtype)
        elif not isinstance(model, torch.nn.Module):
            model = _build_from_config(model, init_seed)
        # cast parameters only: buffers such as RoPE's inv_freq stay float32, as Hugging Face loads them
        self.model = model.to(device=self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
            if p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
        self.version: int = int(version)
        self.resume_timeout_s = float(resume_timeout_s)
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(int(seed))
        self._weights_lock = threading.Lock()
        # a running call holds here (releasing the lock) while an in-flight update loads weights
        self._held = threading.Condition(self._weights_lock)
        self._hold_mode: str | None = None
        self._holding = 0  # running calls held now
        self._resumed = threading.Event()
        self._resumed.set()
        # continuous batching: one decoding loop at a time; calls with its sampling settings join it between steps
        self._join_lock = threading.Lock()
        self._loop_active = False
        self._running_key: tuple | None = None
        self._joins: list[_Join] = []
        # wakes the calls that wait (for the running loop to end or turn joinable, for resume) on their event loops
        self._wakeup = Wakeup()
        # name -> tensor for every HF name the model answers to (tied weights appear under both names)
        self._named: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._pending_version: int | None = None
        self._updated: set[int] = set()
        self._update_started = 0.0
        self._num_generate_calls = 0
        self._routers = find_routers(self.model)
        #: the routing facts of a MoE model (:mod:`rollout_sglang.routing`); None for a dense model
        self.routing_layout: RoutingLayout | None = routing_layout_of(self.model)
        self._adapters = AdapterRows(self.model)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(
        cls,
        hf_config: Any,
        *,
        init_seed: int | None = None,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = torch.float32,
        **kwargs: Any,
    ) -> "LocalEngine":
        """A randomly initialised model built from a ``transformers`` config (e.g. ``Qwen2Config``).

        init_seed: when given, the initialisation is reproducible (torch's global RNG is left unchanged).
        Other keyword arguments go to :class:`LocalEngine`.
        """
        return cls(hf_config, init_seed=init_seed, device=device, dtype=dtype, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = torch.float32,
        **kwargs: Any,
    ) -> "LocalEngine":
        """Load a Hugging Face checkpoint directory (``config.json`` + safetensors), offline.

        Raises FileNotFoundError naming the path and the fix when there is no checkpoint there.
        """
        return cls(Path(path), device=device, dtype=dtype, **kwargs)

    # ---------------------------------------------------------------- generation
    async def _wait_resumed(self) -> None:
        """Wait until the engine is not paused (woken by :meth:`resume`); TimeoutError after resume_timeout_s."""
        try:
            await self._wakeup.until(lambda: self._resumed.is_set() or None, self.resume_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"LocalEngine stayed paused for more than {self.resume_timeout_s:.1f}s; call resume() "
                               "after the weight update (or raise resume_timeout_s)") from None

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       routing_from: list[int] | None = None,
                       adapters: list[str | None] | None = None,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """Continue each prompt; one :class:`GenerationOutput` per prompt, in order.

        prompts: B lists of token ids (any lengths >= 1). Waits while the engine is paused. Each output carries
        the weight version of each of its tokens (a row with an adapter: the adapter's); a call that an in-flight
        update held (``pause(mode)``) holds two.
        adapters: one per prompt, the name of a loaded adapter (:meth:`load_adapter`) or None for the base;
            KeyError naming one that is not loaded.
        routing_from: MoE models: a start per prompt in ``[0, len(prompt)]``; output ``i`` then carries the
            experts chosen for positions ``[routing_from[i], len(prompt) + len(generated) - 1)``
            (``[positions, MoE layers, top-k]`` in :attr:`routing_layout`'s dtype). ValueError for a dense
            model or a start out of range.
        seeds: one seed or None per prompt, in place of ``params.seed + i`` (:func:`row_seeds`).
        """
        if not prompts:
            return []
        self._check_inputs(prompts, params)
        seeds = row_seeds(prompts, params, seeds)
        if routing_from is not None:
            routing_from = self._check_routing_from(prompts, routing_from)
        adapters = check_adapters(prompts, adapters)
        def start_or_join() -> str | concurrent.futures.Future | None:
            """Start the decoding loop when none runs ("start"), or join the running one (its future); None while a
            loop runs that this call cannot join (other settings, a pause)."""
            with self._join_lock:
                if not self._loop_active:
                    self._loop_active = True
                    return "start"
                return self._try_join_locked(prompts, params, adapters, routing_from, seeds)

        # woken when the running loop ends or turns joinable
        got = await self._wakeup.until(start_or_join)
        if got != "start":
            return await asyncio.wrap_future(got)
        try:
            await self._wait_resumed()
            return await asyncio.to_thread(self._decode, prompts, params, routing_from, adapters, seeds)
        finally:
            with self._join_lock:
                self._loop_active = False
            self._wakeup.notify()

    async def score(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        """Each token's log-prob given the tokens before it, under the current weights of the base model (no
        adapter), untempered (:meth:`Engine.score <rollout_sglang.engines.protocol.Engine.score>`): ``out[i][t] =
        log_softmax(fp32 logits at t - 1)[sequences[i][t]]`` for ``t >= max(starts[i], 1)``, 0.0 before.

        Waits while the engine is paused, then runs in a worker thread under the weights lock (a pause that holds
        running calls, made after that wait, holds this one before its first forward; weights never change
        between its forwards). Sequences go longest first, right-padded with an attention mask and positions
        ``0..len - 1``, at most :data:`SCORE_CHUNK_TOKENS` positions (pads included) per forward; a sequence with
        nothing to score takes none. A decoding loop that runs holds the lock until it ends, so a call waits for
        it. ValueError (:func:`~rollout_sglang.engines.protocol.check_score_inputs`) naming an empty sequence, an
        id outside ``[0, vocab_size)`` or a start outside ``[0, len(sequence)]``.
        """
        seqs, firsts = check_score_inputs(sequences, starts, self.vocab_size)
        if not seqs:
            return []
        await self._wait_resumed()
        return await asyncio.to_thread(self._score, seqs, firsts)

    def _score(self, seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        """:meth:`score`'s forwards (in a worker thread): the log-probs of each sequence, 0.0 where not scored."""
        out = [[0.0] * len(q) for q in seqs]
        todo = sorted((i for i, q in enumerate(seqs) if max(starts[i], 1) < len(q)), key=lambda i: -len(seqs[i]))
        chunks: list[list[int]] = []
        for i in todo:  # longest first: a chunk's first sequence is its widest
            if chunks and (len(chunks[-1]) + 1) * len(seqs[chunks[-1][0]]) <= SCORE_CHUNK_TOKENS:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        with self._weights_lock:
            if self._hold_mode is not None:  # paused (in flight) after the resume check: hold first
                self._hold_until_resumed()
            for chunk in chunks:
                width = len(seqs[chunk[0]])
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, i in enumerate(chunk):
                    ids[r, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
                    mask[r, :len(seqs[i])] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                positions = torch.arange(width, device=self.device).expand(len(chunk), width)
                with self._adapters.assign([None] * len(chunk)), torch.inference_mode():
                    logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                        use_cache=False).logits
                    for r, i in enumerate(chunk):
                        first, n = max(starts[i], 1), len(seqs[i])
                        logp = torch.log_softmax(logits[r, first - 1:n - 1].float(), dim=-1)
                        out[i][first:] = logp.gather(-1, ids[r, first:n, None])[:, 0].tolist()
                del logits
        return out

    def _check_routing_from(self, prompts: list[list[int]], routing_from: list[int]) -> list[int]:
        """ValueError unless the model is MoE and the starts fit the prompts (:func:`routing_starts`)."""
        if self.routing_layout is None:
            raise ValueError(f"routing_from given, but {type(self.model).__name__} is a dense model (no MoE router "
                             "modules): there are no routed experts to return; call generate without routing_from "
                             "(rollout.capture_routing=off or auto)")
        return routing_starts(prompts, routing_from)

    def _check_inputs(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Raise ValueError for empty prompts, out-of-vocabulary ids or bad sampling settings."""
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"prompt {i} has token id {lo if lo < 0 else hi} outside the model vocabulary "
                    f"[0, {self.vocab_size}); is the tokenizer larger than the model's vocab_size?"
                )
        if params.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} must be >= 0")
        if params.temperature < 0:
            raise ValueError(f"temperature={params.temperature} must be >= 0 (0 means greedy)")
        if not (0.0 < params.top_p <= 1.0):
            raise ValueError(f"top_p={params.top_p} must be in (0, 1]")

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row. logits: [b, V] float32; generators: each row's (None: the engine's).
        Returns (tokens [b], logprobs [b] float32).

        temperature 0 is greedy, with log-probs of the untempered distribution.
        """
        if params.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
            return tok, logp.gather(-1, tok[:, None])[:, 0]
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(_truncate_logits(scaled, params.top_k, params.top_p), dim=-1)
        if all(g is None for g in generators):
            tok = torch.multinomial(probs, 1, generator=self._generator)[:, 0]
        else:
            tok = torch.cat([torch.multinomial(probs[i], 1, generator=g or self._generator)
                             for i, g in enumerate(generators)])
        return tok, logp.gather(-1, tok[:, None])[:, 0]

    def _decode(self, prompts: list[list[int]], params: SamplingParams, routing_from: list[int] | None,
                adapters: list[str | None] | None, seeds: list[int | None]) -> list[GenerationOutput]:
        """Run one call's decoding loop (in a worker thread, under the weights lock), which the calls that arrive
        meanwhile join; its outputs."""
        with self._weights_lock:
            rows = self._new_rows(prompts, params, adapters, routing_from, seeds)
            with self._adapters.assign([r.adapter for r in rows]), torch.inference_mode(), \
                    RouterCapture(self._routers) as capture:
                return self._decode_locked(rows, params, capture)

    def _join_key(self, params: SamplingParams) -> tuple:
        """What calls must share to run in one batch: the sampling settings (each row keeps its own seed)."""
        return (params.temperature, params.top_p, params.top_k, tuple(sorted(params.stop_token_ids)))

    def _try_join_locked(self, prompts: list[list[int]], params: SamplingParams, adapters: list[str | None] | None,
                         routing_from: list[int] | None,
                         seeds: list[int | None]) -> concurrent.futures.Future | None:
        """Under the join lock: queue a call to join the running one at its next decode step (continuous batching);
        its future, or None when the running one cannot take it (other sampling settings, a pause, no new
        tokens asked)."""
        if (self._running_key is None or self._running_key != self._join_key(params) or not self._resumed.is_set()
                or params.max_new_tokens == 0):
            return None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._joins.append(_Join(self._new_rows(prompts, params, adapters, routing_from, seeds), fut))
        self._num_generate_calls += 1
        return fut

    def _new_rows(self, prompts: list[list[int]], params: SamplingParams, adapters: list[str | None] | None,
                  routing_from: list[int] | None, seeds: list[int | None]) -> list[_Row]:
        """One :class:`_Row` per prompt: its cap, stop tokens, adapter, generator (its seed's; None: unseeded) and
        routing start."""
        stop = frozenset(int(t) for t in params.stop_token_ids)
        rows = []
        for i, prompt in enumerate(prompts):
            gen = None
            if seeds[i] is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seeds[i])
            rows.append(_Row(i, list(prompt), int(params.max_new_tokens), stop, adapters[i] if adapters else None,
                             gen, None if routing_from is None else int(routing_from[i])))
        return rows

    def _prefill(self, seqs: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
        """One forward of ``seqs``, left-padded, under the weights and adapter rows set now: ``(cache, attention mask
        [b, width], last logits [b, V] float32, width)``."""
        from transformers import DynamicCache

        width = max(len(q) for q in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, width - len(q):] = torch.tensor(q, dtype=torch.long)
            mask[i, width - len(q):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, mask, out.logits[:, -1].float(), width

    def _prefill_rows(self, rows: list[_Row], capture: RouterCapture) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """:meth:`_prefill` of the rows' prompts, recording the routing of the prompt positions each row asked for
        (from its start; left pads dropped): ``(cache, mask, last logits)``."""
        self._adapters.select([r.adapter for r in rows])
        cache, mask, logits, width = self._prefill([r.prompt for r in rows])
        if self._routers:
            chosen = capture.take(len(rows), width)
            for i, r in enumerate(rows):
                if r.routing_from is not None:
                    r.record.append(chosen[i, width - len(r.prompt) + r.routing_from:])
        return cache, mask, logits

    def _decode_locked(self, rows: list[_Row], params: SamplingParams,
                       capture: RouterCapture) -> list[GenerationOutput]:
        """The decoding loop of a call's ``rows``: sample, drop the rows that ended, admit the calls that joined
        (their prompts prefilled, their cache merged in), hold for an in-flight update, decode one step; until no
        row is left and none waits to join."""
        self._num_generate_calls += 1
        dev = self.device
        if self._hold_mode is not None:  # paused (in flight) after this call passed the resume check: hold first
            self._hold_until_resumed()
        if params.max_new_tokens == 0:  # SGLang returns the prefill's routing then: [start, len - 1)
            if any(r.routing_from is not None for r in rows):
                self._prefill_rows(rows, capture)
            return [self._output(r) for r in rows]
        cache, mask, logits = self._prefill_rows(rows, capture)
        live = list(rows)  # the rows in the batch, in batch order
        next_pos = torch.tensor([len(r.prompt) for r in rows], dtype=torch.long, device=dev)
        # other calls join between decode steps, unless this cache cannot be merged (a sliding-window layer)
        joinable = all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
        with self._join_lock:
            self._running_key = self._join_key(params) if joinable else None
        self._wakeup.notify()  # the calls of its settings that wait may join now
        joined: list[_Join] = []
        try:
            while True:
                tok, lp = self._sample(logits, params, [r.generator for r in live])
                keep = self._append_sampled(live, tok.tolist(), lp.tolist(), joined)
                admit = self._take_joins(bool(keep))
                if not keep and not admit:
                    break
                if keep and len(keep) < len(live):
                    idx = torch.tensor(keep, dtype=torch.long, device=dev)
                    cache.batch_select_indices(idx)
                    mask, next_pos, tok = mask[idx], next_pos[idx], tok[idx]
                live = [live[j] for j in keep]
                self._adapters.select([r.adapter for r in live])
                if self._hold_mode is not None and self._hold_until_resumed() == "retract" and live:
                    # the routers' choices of this recompute are not recorded: a position keeps those of the
                    # forward that sampled from it
                    cache, mask, _, _ = self._prefill([r.prompt + r.tokens[:-1] for r in live])
                if live:
                    mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=dev)], dim=1)
                    out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                     past_key_values=cache, use_cache=True)
                    if self._routers:  # position len(prompt) + step of each live row (>= its start)
                        chosen = capture.take(len(live), 1)
                        for j, r in enumerate(live):
                            if r.routing_from is not None:
                                r.record.append(chosen[j])
                    logits = out.logits[:, -1].float()
                    next_pos = next_pos + 1
                if admit:
                    new_rows = [r for j in admit for r in j.rows]
                    c2, m2, l2 = self._prefill_rows(new_rows, capture)
                    p2 = torch.tensor([len(r.prompt) for r in new_rows], dtype=torch.long, device=dev)
                    if live:
                        cache, mask = _merge_caches(cache, mask, c2, m2)
                        logits, next_pos = torch.cat([logits, l2]), torch.cat([next_pos, p2])
                    else:
                        cache, mask, logits, next_pos = c2, m2, l2, p2
                    live += new_rows
                    joined += admit
                    self._adapters.select([r.adapter for r in live])
        except BaseException as e:
            for j in joined + self._take_joins(False, final=True):
                if not j.future.done():
                    j.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            raise
        finally:
            with self._join_lock:
                self._running_key = None
        return [self._output(r) for r in rows]

    def _append_sampled(self, live: list[_Row], toks: list[int], lps: list[float], joined: list[_Join]) -> list[int]:
        """Append each live row's sampled token; a row that stopped or reached its cap is done (a joined call whose
        rows are all done gets its outputs). The batch positions of the rows that go on."""
        keep = []
        for j, (r, t, lp) in enumerate(zip(live, toks, lps)):
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(self._adapters.version_of(r.adapter) if r.adapter is not None else self.version)
            if t in r.stop:
                r.reason = "stop"
            elif len(r.tokens) < r.cap:
                keep.append(j)
                continue
            r.done = True
        for call in joined:
            if not call.future.done() and all(r.done for r in call.rows):
                call.future.set_result([self._output(r) for r in call.rows])
        return keep

    def _take_joins(self, running: bool, final: bool = False) -> list[_Join]:
        """The calls waiting to join; when none waits and nothing runs (``running`` False), the loop ends: no call
        may join any more. ``final``: take them whatever the state (the loop failed)."""
        with self._join_lock:
            take, self._joins = self._joins, []
            if not take and not running or final:
                self._running_key = None
        ready = []
        for call in take:
            # a caller that was cancelled while waiting is left out; once running, its future cannot be cancelled,
            # so setting its result from this thread cannot race the caller's cancellation
            if not call.future.set_running_or_notify_cancel():
                continue
            if all(r.cap == 0 for r in call.rows):
                call.future.set_result([self._output(r) for r in call.rows])
            else:
                ready.append(call)
        return ready

    def _output(self, row: _Row) -> GenerationOutput:
        """A finished row's output, with the routed experts of its positions ``[routing_from, end - 1)`` when asked."""
        version = row.versions[-1] if row.versions else (
            self._adapters.version_of(row.adapter) if row.adapter is not None else self.version)
        out = GenerationOutput(row.tokens, row.logprobs, row.reason, version, token_versions=row.versions)
        if row.routing_from is not None:
            layout = self.routing_layout
            assert layout is not None
            n = max(0, len(row.prompt) + len(row.tokens) - 1 - row.routing_from)
            got = torch.cat(row.record).cpu() if row.record else torch.zeros((0, len(layout.moe_layers), layout.top_k))
            if got.shape[0] < n:
                raise RuntimeError(f"routing capture recorded {got.shape[0]} positions for row {row.index}, "
                                   f"expected {n}")
            out.routed_experts = layout.check(got[:n].numpy(), n, f"local engine ({type(self.model).__name__})")
        return out

    def _hold_until_resumed(self) -> str:
        """Inside a running call, between two decode steps: wait (the weights lock released, so an update can load)
        until :meth:`resume`; the pause's mode. TimeoutError after ``resume_timeout_s``."""
        mode = self._hold_mode
        assert mode is not None
        self._holding += 1
        try:
            resumed = self._held.wait_for(lambda: self._hold_mode is None, timeout=self.resume_timeout_s)
        finally:
            self._holding -= 1
        if not resumed:
            raise TimeoutError(f"LocalEngine held a running generation for more than {self.resume_timeout_s:.1f}s in "
                               f"a pause({mode!r}); call resume() after the weight update (or raise resume_timeout_s)")
        return mode

    # ---------------------------------------------------------------- pause / resume
    def pause(self, mode: str | None = None) -> None:
        """Stop generating: later calls wait for :meth:`resume`. ``mode`` None: a running call finishes;
        ``"in_place"`` / ``"retract"``: a running call holds after its current decode step (the weights lock
        released, so an update loads meanwhile) and continues after :meth:`resume` over its KV cache as it is
        (``in_place``) or recomputed under the new weights (``retract``). ValueError for another mode."""
        if mode is not None and mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)} (or None: let running calls "
                             "finish)")
        self._resumed.clear()
        self._hold_mode = mode

    def resume(self) -> None:
        """Admit generation again; a call held by ``pause(mode)`` continues."""
        with self._held:
            self._hold_mode = None
            self._resumed.set()
            self._held.notify_all()
        self._wakeup.notify()

    # ---------------------------------------------------------------- weights
    def begin_weight_update(self, version: int, metadata: dict | None = None) -> None:
        """Start an update to ``version``; ``metadata`` (names, shapes, dtypes) is only logged.

        Raises RuntimeError when an update is already open.
        """
        if self._pending_version is not None:
            raise RuntimeError(
                f"weight update to version {self._pending_version} is still open; call end_weight_update() first"
            )
        self._pending_version = int(version)
        self._updated = set()
        self._update_started = time.monotonic()
        logger.debug("weight update to version %d begins (metadata keys: %s)", version, sorted((metadata or {}).keys()))

    def receive_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (Hugging Face name, tensor) pairs into the model (cast to the engine's device/dtype).

        Blocks while a generation is running. Raises KeyError for an unknown name (with close
        matches), ValueError for a shape mismatch, RuntimeError outside begin/end.
        """
        if self._pending_version is None:
            raise RuntimeError("receive_bucket() called outside a weight update; call begin_weight_update() first")
        with self._weights_lock, torch.no_grad():
            for name, tensor in named_tensors:
                owner, target = self.weight_target(name)
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"shape mismatch for {name!r}: engine has {tuple(target.shape)}, received "
                        f"{tuple(tensor.shape)}; do the trainer and engine use the same model config?"
                    )
                target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
                self._updated.add(id(owner))

    def weight_target(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(model tensor, the part of it named)`` for the Hugging Face name ``name``: the tensor itself, or for
        one expert of a fused MoE layer (``...experts.<e>.gate_proj.weight``) its slice of the fused tensor.

        Raises KeyError for a name the model does not have, with close matches.
        """
        target = self._named.get(name)
        if target is not None:
            return target, target
        m = _PER_EXPERT_RE.match(name)
        if m is not None:
            e, proj = int(m.group("e")), m.group("proj")
            fused = self._named.get(m.group("prefix") + (".down_proj" if proj == "down_proj" else ".gate_up_proj"))
            if fused is not None and fused.dim() == 3 and e < fused.shape[0]:
                if proj == "down_proj":
                    return fused, fused[e]
                half = fused.shape[1] // 2
                return fused, (fused[e, :half] if proj == "gate_proj" else fused[e, half:])
        close = difflib.get_close_matches(name, list(self._named), n=3)
        raise KeyError(f"unknown parameter name {name!r} for {type(self.model).__name__}; weights must use "
                       f"Hugging Face names (close matches: {close or 'none'}; e.g. {next(iter(self._named))!r})")

    def end_weight_update(self) -> None:
        """Finish the update: the engine now serves the new version. Parameters not received are logged."""
        if self._pending_version is None:
            raise RuntimeError("end_weight_update() without begin_weight_update()")
        with self._weights_lock:  # a running call is held (in flight) or none runs (drained): no forward sees it
            self._finish_update()

    def _finish_update(self) -> None:
        missing = sorted(
            {n for n, t in self._named.items() if id(t) not in self._updated and isinstance(t, torch.nn.Parameter)}
        )
        if missing:
            logger.warning(
                "weight update to version %d did not receive %d parameter(s), kept old values: %s",
                self._pending_version, len(missing), missing[:10] + (["..."] if len(missing) > 10 else []),
            )
        self.version = self._pending_version
        self._pending_version = None
        logger.debug("engine serves weight version %d (update took %.3fs)", self.version,
                     time.monotonic() - self._update_started)

    def load_adapter(self, adapter: Adapter) -> None:
        """Load ``adapter`` beside the others (unmerged; waits for a running generation). ValueError when it does
        not fit the model or its name is loaded already."""
        with self._weights_lock:
            self._adapters.add(adapter)
        logger.debug("adapter %s (version %d, %d tensors) loaded", adapter.name, adapter.version, len(adapter.tensors))

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (waits for a running generation); KeyError when it is not loaded."""
        with self._weights_lock:
            self._adapters.remove(name)

    @property
    def adapters(self) -> list[str]:
        """The names of the adapters loaded."""
        return self._adapters.names()

    def load_state_dict(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """begin_weight_update + one bucket with all of ``state`` + end_weight_update."""
        self.begin_weight_update(version, {})
        try:
            self.receive_bucket(state.items())
        except Exception:
            self._pending_version = None
            raise
        self.end_weight_update()

    # ---------------------------------------------------------------- status
    def health(self) -> dict:
        """``{"ok", "version", "paused", "pause_mode", "held" (running calls held by an in-flight pause), "updating",
        "device", "dtype", "num_parameters", "generate_calls", "adapters"}``."""
        return {
            "ok": True,
            "version": self.version,
            "paused": not self._resumed.is_set(),
            "pause_mode": self._hold_mode,
            "held": self._holding,
            "updating": self._pending_version is not None,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "generate_calls": self._num_generate_calls,
            "adapters": self._adapters.names(),
        }
