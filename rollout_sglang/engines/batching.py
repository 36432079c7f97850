"""An Engine wrapper that merges concurrent ``generate`` calls into batched calls.

With many trajectory groups in flight (the asynchronous pipeline), each group's turn is a
small ``generate`` call. Engines that run one call at a time (the local PyTorch engine) would
then decode 4 rows where they could decode 64. :class:`BatchingEngine` queues the calls that
arrive while the engine is busy and sends them as one call when it is free (no timer: an idle
engine takes a lone call at once), splitting the outputs back.

Merging: calls are merged when their temperature, top-p, top-k and stop tokens agree; the
merged call uses the largest ``max_new_tokens`` and each call's rows are cut back to its own
cap (exactly what a capped call samples, since rows sample independently). Each row keeps its seed (its call's
``seeds``, or ``params.seed + i``, or none): a merged call hands the wrapped engine one seed per row, so what a
seeded call samples does not depend on what it was merged with. Routing (``routing_from``, MoE models)
is per row: calls with and without it merge; when any merged call asks, the engine is asked for every
row (a row that did not ask starts at its prompt's end, the least there is, and gets None back), and a row
cut back to its cap keeps the routing of the positions it kept. LoRA adapters (``adapters``) are per row too:
calls of different adapters merge, as SGLang batches several adapters.

An engine that batches on its own (``continuous_batching = True``: SGLang's scheduler, the local engine, where a
call joins the running one between two decode steps) gets every call as it comes, concurrently: merging calls here
would make each wait for the longest of its merged batch.

Weight updates go through the version pool: :meth:`pause` holds the calls that arrive later and pauses the wrapped
engine, so no generation ever sees half-loaded weights; the calls running then finish first (the pool drained the
slot) or are held by the engine and continue on the new weights after :meth:`resume` (an in-flight update).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams, check_adapters, row_seeds

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future
    routing_from: list[int] | None = None
    adapters: list[str | None] | None = None
    seeds: list[int | None] | None = None


def _merge_key(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_p, p.top_k, tuple(p.stop_token_ids))


def _cut(out: GenerationOutput, call: _Call, row: int) -> GenerationOutput:
    """Row ``row`` of ``call`` as the call asked for it: at most its own ``max_new_tokens`` (the routing of the
    positions kept), routing only when the call asked."""
    cap = call.params.max_new_tokens
    routed = out.routed_experts if call.routing_from is not None else None
    if len(out.token_ids) <= cap:
        return out if routed is out.routed_experts else dataclasses.replace(out, routed_experts=routed)
    if routed is not None:
        routed = routed[:max(0, len(call.prompts[row]) + cap - 1 - call.routing_from[row])]
    versions = out.token_versions[:cap]
    last = versions[-1] if versions else out.version
    return GenerationOutput(out.token_ids[:cap], out.logprobs[:cap], "length", last, routed, token_versions=versions)


class BatchingEngine:
    """Wraps an engine (the Engine protocol); merges concurrent generate calls (see module doc).

    engine: the wrapped engine. max_batch_rows: most rows in one merged call.
    resume_timeout_s: how long a held call waits for :meth:`resume` before failing.
    Counters: ``busy_s`` (seconds the wrapped engine spent generating), ``calls`` and
    ``rows`` (engine calls issued, rows generated), ``merged_calls`` (caller calls served).
    """

    def __init__(self, engine: Any, max_batch_rows: int = 512, resume_timeout_s: float = 600.0) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows={max_batch_rows} must be >= 1")
        self.engine = engine
        self.max_batch_rows = int(max_batch_rows)
        self.resume_timeout_s = float(resume_timeout_s)
        self.busy_s = 0.0
        self.calls = 0
        self.rows = 0
        self.merged_calls = 0
        self._pending: list[_Call] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task | None = None
        self._resumed = threading.Event()
        self._resumed.set()
        self._busy_since: float | None = None
        self._active = 0  # engine calls running
        self._running: set[asyncio.Task] = set()
        self._lock = threading.Lock()
        #: the wrapped engine batches concurrent calls itself: each call goes to it as it comes
        self.concurrent = bool(getattr(engine, "continuous_batching", False))

    # ------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        """The wrapped engine's weight version."""
        return int(self.engine.version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       routing_from: list[int] | None = None,
                       adapters: list[str | None] | None = None,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """Queue the call; it runs alone or merged with others (outputs in prompt order). ``routing_from``,
        ``adapters`` and ``seeds``: as :meth:`Engine.generate <rollout_sglang.engines.protocol.Engine.generate>`,
        one per prompt."""
        if not prompts:
            return []
        adapters = check_adapters(prompts, adapters)
        if seeds is not None:
            seeds = row_seeds(prompts, params, seeds)
        if routing_from is not None:
            routing_from = list(routing_from)
            if len(routing_from) != len(prompts):
                raise ValueError(f"routing_from has {len(routing_from)} starts for {len(prompts)} prompts; give one "
                                 "per prompt")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (e.g. an evaluation after the rollout loop ended)
            self._loop, self._worker, self._pending = loop, None, []
        fut: asyncio.Future = loop.create_future()
        self._pending.append(_Call([list(p) for p in prompts], params, fut, routing_from, adapters, seeds))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._work())
        return await fut

    async def score(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        """The wrapped engine's :meth:`Engine.score <rollout_sglang.engines.protocol.Engine.score>`, passed through
        (no merging); the wrapped engine waits out its own pause."""
        return await self.engine.score(sequences, starts)

    async def _wait_resumed(self) -> None:
        deadline = time.monotonic() + self.resume_timeout_s
        while not self._resumed.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine stayed paused for more than {self.resume_timeout_s:.0f}s; "
                                   "a weight update did not finish (see the trainer's log)")
            await asyncio.sleep(0.005)

    async def _work(self) -> None:
        while self._pending:
            if self.concurrent:
                c = self._pending.pop(0)
                if not c.future.done() and await self._start([c]):
                    task = asyncio.get_running_loop().create_task(self._run([c]))
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)
                continue
            key = _merge_key(self._pending[0].params)
            take: list[_Call] = []
            rest: list[_Call] = []
            rows = 0
            for c in self._pending:
                if c.future.done():  # the caller was cancelled
                    continue
                if _merge_key(c.params) == key and (not take or rows + len(c.prompts) <= self.max_batch_rows):
                    take.append(c)
                    rows += len(c.prompts)
                else:
                    rest.append(c)
            self._pending = rest
            if take and await self._start(take):
                await self._run(take)

    async def _start(self, take: list[_Call]) -> bool:
        """Wait for resume, then mark the engine busy atomically with the check (a pause in between holds the
        call); False (every waiting call failed) when the pause outlasted ``resume_timeout_s``."""
        while True:
            try:
                await self._wait_resumed()
            except TimeoutError as e:
                for c in take + self._pending:
                    if not c.future.done():
                        c.future.set_exception(e)
                self._pending = []
                return False
            with self._lock:
                if self._resumed.is_set():
                    if self._active == 0:
                        self._busy_since = time.perf_counter()
                    self._active += 1
                    return True

    async def _run(self, take: list[_Call]) -> None:
        """One engine call for ``take`` (the worker marked the engine busy already)."""
        prompts = [p for c in take for p in c.prompts]
        seeds: list[int | None] | None
        if len(take) == 1:
            params, seeds = take[0].params, take[0].seeds
        else:
            params = dataclasses.replace(take[0].params, max_new_tokens=max(c.params.max_new_tokens for c in take),
                                         seed=None)
            seeds = [s for c in take for s in row_seeds(c.prompts, c.params, c.seeds)]
            if all(s is None for s in seeds):
                seeds = None
        routing: list[int] | None = None
        if any(c.routing_from is not None for c in take):
            routing = [s for c in take
                       for s in (c.routing_from if c.routing_from is not None else [len(p) for p in c.prompts])]
        kwargs: dict = {}
        if routing is not None:
            kwargs["routing_from"] = routing
        if any(c.adapters is not None for c in take):
            kwargs["adapters"] = [a for c in take for a in (c.adapters or [None] * len(c.prompts))]
        if seeds is not None:
            kwargs["seeds"] = seeds
        try:
            outs = await self.engine.generate(prompts, params, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the merged call
            for c in take:
                if not c.future.done():
                    c.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
            return
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.busy_s += time.perf_counter() - (self._busy_since or time.perf_counter())
                    self._busy_since = None
        self.calls += 1
        self.rows += len(prompts)
        self.merged_calls += len(take)
        i = 0
        for c in take:
            mine = outs[i: i + len(c.prompts)]
            i += len(c.prompts)
            cut = [_cut(o, c, j) for j, o in enumerate(mine)]
            if not c.future.done():
                c.future.set_result(cut)

    def busy_seconds(self) -> float:
        """``busy_s`` including the call running now (thread-safe)."""
        with self._lock:
            extra = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
            return self.busy_s + extra

    # ------------------------------------------------------------ pause / weights
    def pause(self, mode: str | None = None) -> None:
        """Hold new engine calls and pause the wrapped engine with ``mode`` (:meth:`Engine.pause`). With None, call it
        when no call runs (the version pool drains a slot first): an engine whose plain pause aborts requests, like
        SGLang's, would lose the running one; with "in_place" or "retract" the running call is held and continues."""
        with self._lock:
            self._resumed.clear()
        if mode is None:
            self.engine.pause()
        else:
            self.engine.pause(mode)

    def resume(self) -> None:
        """Resume the wrapped engine and release held calls."""
        self.engine.resume()
        self._resumed.set()

    def begin_weight_update(self, version: int, metadata: dict | None = None) -> None:
        """Delegated to the wrapped engine."""
        self.engine.begin_weight_update(version, metadata or {})

    def receive_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Delegated to the wrapped engine."""
        self.engine.receive_bucket(named_tensors)

    def end_weight_update(self) -> None:
        """Delegated to the wrapped engine."""
        self.engine.end_weight_update()

    def load_adapter(self, adapter: Any) -> None:
        """Delegated to the wrapped engine (:class:`~rollout_sglang.engines.protocol.AdapterEngine`)."""
        self.engine.load_adapter(adapter)

    def unload_adapter(self, name: str) -> None:
        """Delegated to the wrapped engine."""
        self.engine.unload_adapter(name)

    def abort_weight_update(self) -> None:
        """Close a failed update: the wrapped engine's ``abort_weight_update`` (an SGLang client forgets the
        open update without stamping a version), or ``end_weight_update`` for engines that have none."""
        abort = getattr(self.engine, "abort_weight_update", None)
        if callable(abort):
            abort()
        else:
            self.engine.end_weight_update()

    def abandon(self) -> None:
        """Give up the engine call running now (thread-safe): the version pool took the engine out of rotation
        (stalled or dead), its callers went elsewhere, and calls after its return must not queue behind a call
        that may never end (an SGLang request then closes its connection)."""
        loop, worker = self._loop, self._worker
        if loop is None:
            return
        for task in [worker, *self._running]:
            if task is None or task.done():
                continue
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its event loop has closed: nothing runs there any more
                return

    @property
    def name(self) -> str:
        """The wrapped engine's name (an SGLang server's URL)."""
        return str(getattr(self.engine, "name", None) or repr(self.engine))

    @property
    def flush_if_stale(self) -> Any:
        """The wrapped engine's owed prefix-cache flush (``flush_if_stale() -> bool``), None when it has none."""
        return getattr(self.engine, "flush_if_stale", None)

    @property
    def probe(self) -> Any:
        """The wrapped engine's health probe (``probe(timeout_s) -> Probe``), None when it has none (an
        in-process engine cannot fail apart from its caller)."""
        return getattr(self.engine, "probe", None)

    def health(self) -> dict:
        """The wrapped engine's health plus this wrapper's counters."""
        h = dict(self.engine.health())
        h.update({"batching_calls": self.calls, "batching_rows": self.rows,
                  "paused_wrapper": not self._resumed.is_set()})
        return h

    def __repr__(self) -> str:
        return f"BatchingEngine({self.engine!r})"
