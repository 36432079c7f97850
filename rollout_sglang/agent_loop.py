"""The agent loop: environment messages in, tokens out, and back; one Trajectory per episode.

Token-in / token-out: the prompt is encoded once, every generated turn is appended as the
engine produced it (``loss_mask`` 1, its behaviour log-probs, the weight version that sampled
it), and every environment reply is appended as the template's incremental piece
(``loss_mask`` 0). Nothing is ever re-tokenized, so the trainer scores exactly the tokens the
engine sampled.

:func:`run_group_lockstep` runs a set of episodes (typically the samples of one or a few GRPO
groups) in lockstep: per turn, one batched ``engine.generate`` over every episode still running,
then all their environment calls concurrently.

Given a :class:`~rollout_sglang.engines.version_pool.VersionPool` instead of one engine, every turn of
every episode is routed by the pool: its cross-policy draws a weight-version slot per turn, its
router keeps an episode's turns on one engine of the slot where it can (prefix-cache reuse), and
the episodes that land on the same engine share one batched call. Each turn records the version
that sampled it and that engine's per-token log-probs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from env_controller.protocol import SampleStatus, TaskReply
from rollout_sglang.chat_template import AnyChatTemplate
from rollout_sglang.engines.protocol import Engine, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
from rollout_sglang.tool_parser import ToolCallParseError
from rollout_sglang.trajectory import INTERNAL_ERROR, Trajectory

logger = logging.getLogger(__name__)


class EnvClient(Protocol):
    """The trainer-facing side of the environment controller (in-process, or over HTTP).

    A client may also have ``start_wait_s``: how much longer than the env timeout a start may take
    while it waits for an unavailable controller (the HTTP client's ``unavailable_timeout_s``).
    """

    async def start_sample(self, task: str, index: int) -> tuple[str, TaskReply]:
        """Start an episode of ``task`` sample ``index``; returns (session_id, first reply)."""
        ...

    async def interact(self, session_id: str, messages: list[dict]) -> TaskReply:
        """Send ``[assistant message]`` (with ``tool_calls`` when the policy called tools); returns the reply."""
        ...

    async def cancel(self, session_id: str) -> None:
        """End the session early and free its resources."""
        ...


@dataclass
class _Episode:
    """Book-keeping of one running episode."""

    traj: Trajectory
    session_id: str | None = None
    tools: list[dict] = field(default_factory=list)
    done: bool = False
    num_calls: int = 0
    turn_end: int | None = None  # the stop token that ended the last turn; None: cut by length
    routing: list[np.ndarray] = field(default_factory=list)  # routed experts of positions [0, routed) in pieces
    routed: int = 0
    routing_lost: bool = False  # an engine answered without routing: the episode trains on the trainer's own


def _finish(
    ep: _Episode, status: SampleStatus | str, reward: float = 0.0, metrics: dict | None = None, error: str = ""
) -> None:
    """Mark the episode done with a final status, reward, metrics and (for abnormal ends) the error text."""
    ep.done = True
    ep.traj.error = error
    ep.traj.status = status.value if isinstance(status, SampleStatus) else str(status)
    ep.traj.reward = float(reward)
    if metrics:
        ep.traj.metrics.update({k: float(v) for k, v in metrics.items()})


def _append(ep: _Episode, tokens: Sequence[int]) -> None:
    """Append tokens the policy did not sample (the prompt, an env reply) to the trajectory."""
    ep.traj.append_context([int(x) for x in tokens])


def _add_routing(ep: _Episode, routed: np.ndarray | None, end: int) -> None:
    """Keep a turn's routed experts (positions ``[ep.routed, ...)``) up to position ``end`` (the turn's last
    token, which no forward pass has run yet); a turn without routing leaves the episode without any."""
    need = end - ep.routed
    if routed is None or len(routed) < need:
        if not ep.routing_lost:
            got = "none" if routed is None else f"{len(routed)} positions from {ep.routed}, {need} needed"
            logger.warning("%s #%d: the engine returned routed experts for %s; this episode trains on the "
                           "trainer's own routing", ep.traj.task, ep.traj.index, got)
        ep.routing_lost = True
        return
    ep.routing.append(routed[:need])
    ep.routed = end


def _shorten_repr(e: BaseException, limit: int = 500) -> str:
    """``repr(e)`` cut to ``limit`` characters, for the trajectory's error text."""
    r = repr(e)
    return r if len(r) <= limit else r[: limit - 4] + " ..."


async def _cancel(env: EnvClient, ep: _Episode, timeout_s: float) -> None:
    """Best-effort cancel of the episode's env session (errors and timeouts are logged, not raised)."""
    if ep.session_id is None:
        return
    try:
        await asyncio.wait_for(env.cancel(ep.session_id), timeout_s)
    except Exception as e:  # noqa: BLE001 - cancel must never fail the batch
        logger.warning("cancel of env session %s (%s #%d) failed: %r", ep.session_id, ep.traj.task, ep.traj.index, e)


async def _start(
    env: EnvClient, template: AnyChatTemplate, ep: _Episode, max_total_tokens: int, timeout_s: float
) -> None:
    """Start the env session and encode the prompt; may finish the episode (env error, context limit)."""
    t = ep.traj
    t0 = time.perf_counter()
    try:
        # a start may wait out a restarting controller (bounded by the client) on top of the call itself
        start_limit = timeout_s + float(getattr(env, "start_wait_s", 0.0) or 0.0)
        ep.session_id, reply = await asyncio.wait_for(env.start_sample(t.task, t.index), start_limit)
    except Exception as e:  # noqa: BLE001
        t.timings["env_s"] = t.timings.get("env_s", 0.0) + time.perf_counter() - t0
        logger.error("start_sample(%s, %d) failed: %r", t.task, t.index, e)
        _finish(ep, SampleStatus.TASK_ERROR, error=f"start_sample failed: {e!r}")
        return
    t.timings["env_s"] = t.timings.get("env_s", 0.0) + time.perf_counter() - t0
    ep.tools = list(reply.tools or [])
    try:
        prompt = template.encode_prompt(reply.messages, ep.tools)
    except Exception as e:  # noqa: BLE001 - a worker's reply is untrusted: it costs this episode only
        logger.error("session %s (%s #%d): cannot render the first messages: %s", ep.session_id, t.task, t.index, e)
        _finish(ep, SampleStatus.TASK_ERROR, error=f"cannot render the first messages: {e}")
        await _cancel(env, ep, timeout_s)
        return
    _append(ep, prompt)
    if reply.finish:
        _finish(ep, reply.status, reply.reward, reply.metrics, error=reply.error)
        return
    if len(prompt) >= max_total_tokens:
        logger.warning(
            "session %s (%s #%d): prompt of %d tokens leaves no room under max_total_tokens=%d",
            ep.session_id, t.task, t.index, len(prompt), max_total_tokens,
        )
        _finish(ep, SampleStatus.AGENT_CONTEXT_LIMIT)
        await _cancel(env, ep, timeout_s)


async def _interact(
    env: EnvClient, template: AnyChatTemplate, ep: _Episode, message: dict[str, Any], limits: EpisodeLimits,
    timeout_s: float,
) -> None:
    """Send the assistant message, then finish the episode or append the env reply (loss_mask 0)."""
    t = ep.traj
    t0 = time.perf_counter()
    try:
        reply = await asyncio.wait_for(env.interact(ep.session_id, [message]), timeout_s)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001
        t.timings["env_s"] = t.timings.get("env_s", 0.0) + time.perf_counter() - t0
        what = f"timed out after {timeout_s:.1f}s" if isinstance(e, asyncio.TimeoutError) else f"failed: {e!r}"
        logger.error("interact on env session %s (%s #%d) %s", ep.session_id, t.task, t.index, what)
        _finish(ep, SampleStatus.TASK_ERROR, error=f"interact {what}")
        await _cancel(env, ep, timeout_s)
        return
    t.timings["env_s"] = t.timings.get("env_s", 0.0) + time.perf_counter() - t0
    if reply.finish:
        _finish(ep, reply.status, reply.reward, reply.metrics, error=reply.error)
        return
    if t.num_turns >= limits.max_turns:
        _finish(ep, SampleStatus.TASK_LIMIT_REACHED)
        await _cancel(env, ep, timeout_s)
        return
    try:
        # a turn cut by length gets the format's turn end first (Qwen2.5: <|im_end|>), an env token
        piece = template.encode_env_reply(reply.messages, ended_with=ep.turn_end)
    except Exception as e:  # noqa: BLE001 - a worker's reply is untrusted: it costs this episode only
        logger.error("env session %s (%s #%d): cannot render the reply: %s", ep.session_id, t.task, t.index, e)
        _finish(ep, SampleStatus.TASK_ERROR, error=f"cannot render the env reply: {e}")
        await _cancel(env, ep, timeout_s)
        return
    if len(t.token_ids) + len(piece) >= limits.max_total_tokens:
        _finish(ep, SampleStatus.AGENT_CONTEXT_LIMIT)
        await _cancel(env, ep, timeout_s)
        return
    _append(ep, piece)


async def run_group_lockstep(
    engine: Engine | VersionPool,
    env: EnvClient,
    template: AnyChatTemplate,
    requests: list[tuple[str, int, int]],
    params: SamplingParams,
    episode: EpisodeOptions,
) -> list[Trajectory]:
    """Run one episode per request in lockstep and return their Trajectories (same order).

    engine: one engine, or a VersionPool (per-turn slot choice by its cross-policy, see the module doc).
    requests: ``(task, index, group_id)`` per episode.
    params: sampling settings of every turn; the template's stop tokens are added to
        ``stop_token_ids``; ``max_new_tokens`` caps each turn; with ``seed`` set, episode ``j`` samples turn
        ``k`` with ``seed + k * len(requests) + j`` (whichever engine of a pool serves it, and whichever other
        episodes still run: the call names each row's seed), so turns and episodes never share a random stream.
    episode: the limits (``max_turns``: an episode still running after that many turns ends with "task limit
        reached" and its env session is cancelled; ``max_total_tokens``: a turn is cut so that prompt, turns and
        env replies never exceed it, and an episode that runs out of room ends with "agent context limit"),
        ``env_timeout_s`` (every env call: start, interact, cancel; a timeout or exception ends the episode
        with "task error", an infrastructure failure: ``Trajectory.infra_failed``) and ``capture_routing``
        (``Trajectory.routed_experts`` ends up holding each position's experts from the engine that sampled
        that turn; None when an engine gave none).

    Final statuses: the env's own (completed, ..., with the env's ``error`` text for "task error"),
    "agent validation failed" (a malformed tool call; reward 0, ``metrics["validation_error"] = 1.0``),
    "task limit reached", "agent context limit", "task error", and "internal error" (any other exception
    from the parser: a bug of ours, logged; it ends only that episode, which is never trained).
    Timings: ``generate_s`` (wall time of the batched generate calls the episode took part in),
    ``env_s`` (its own env calls). If the engine raises, every running session is cancelled and the
    exception propagates.
    """
    episodes = [
        _Episode(
            Trajectory(
                token_ids=[], loss_mask=[], behavior_logprobs=[], versions=[], turn_spans=[],
                task=task, index=int(index), group_id=int(group_id),
                timings={"generate_s": 0.0, "env_s": 0.0},
            )
        )
        for task, index, group_id in requests
    ]
    lockstep = _Lockstep(engine, env, template, episodes, episode)
    limit, timeout_s = episode.limits.max_total_tokens, episode.env_timeout_s
    await asyncio.gather(*(_start(env, template, ep, limit, timeout_s) for ep in episodes))
    try:
        trajs = await lockstep.turns(params)
    finally:
        if lockstep.pool is not None:
            lockstep.pool.forget(list(lockstep.keys.values()))
    if episode.capture_routing:
        for ep in episodes:
            if ep.routing and not ep.routing_lost:
                ep.traj.routed_experts = np.concatenate(ep.routing)
    return trajs


class _Lockstep:
    """The turns of one :func:`run_group_lockstep` call: one generate round over the running episodes, then
    their env calls, until none runs."""

    def __init__(self, engine: Any, env: EnvClient, template: AnyChatTemplate, episodes: list[_Episode],
                 episode: EpisodeOptions) -> None:
        self.engine, self.env, self.template, self.episodes = engine, env, template, episodes
        self.limits, self.timeout_s = episode.limits, episode.env_timeout_s
        self.capture_routing = episode.capture_routing
        self.pool = engine if isinstance(engine, VersionPool) else None
        call_id = object()  # router keys of this call's episodes: (call_id, episode index)
        self.keys = {id(ep): (call_id, i) for i, ep in enumerate(episodes)}

    async def _generate(self, active: list[_Episode], params: SamplingParams, turn: int) -> list[Any]:
        """One turn of the ``active`` episodes; seeded, episode ``j`` samples with ``seed + turn * n + j`` whichever
        others still run (``n`` episodes in all)."""
        prompts = [ep.traj.token_ids for ep in active]
        extra: dict[str, Any] = {"routing_from": [ep.routed for ep in active]} if self.capture_routing else {}
        if params.seed is not None:
            base = params.seed + turn * len(self.episodes)
            extra["seeds"] = [base + self.keys[id(ep)][1] for ep in active]
        if self.pool is None:
            return await self.engine.generate(prompts, params, **extra)
        return await self.pool.generate(prompts, params, keys=[self.keys[id(ep)] for ep in active], **extra)

    async def turns(self, params: SamplingParams) -> list[Trajectory]:
        """Play every episode to its end; their trajectories in request order."""
        template, max_total_tokens = self.template, self.limits.max_total_tokens
        stop_ids = list(dict.fromkeys(list(params.stop_token_ids) + template.stop_token_ids))
        stop_set = set(stop_ids)
        turn = 0
        while True:
            active = [ep for ep in self.episodes if not ep.done]
            if not active:
                break
            caps = [min(params.max_new_tokens, max_total_tokens - len(ep.traj.token_ids)) for ep in active]
            gen_params = dataclasses.replace(params, max_new_tokens=max(caps), stop_token_ids=stop_ids)
            t0 = time.perf_counter()
            try:
                outputs = await self._generate(active, gen_params, turn)
            except BaseException:
                logger.exception("engine.generate failed on turn %d; cancelling %d env sessions", turn, len(active))
                await asyncio.gather(*(_cancel(self.env, ep, self.timeout_s) for ep in active))
                raise
            gen_s = time.perf_counter() - t0
            turn += 1

            pending: list[tuple[_Episode, dict[str, Any]]] = []
            cancels: list[_Episode] = []
            for ep, out, cap in zip(active, outputs, caps):
                message = self._record(ep, out, cap, gen_s, stop_set)
                if message is None:
                    cancels.append(ep)
                else:
                    pending.append((ep, message))

            await asyncio.gather(
                *(_interact(self.env, template, ep, msg, self.limits, self.timeout_s) for ep, msg in pending),
                *(_cancel(self.env, ep, self.timeout_s) for ep in cancels),
            )
        return [ep.traj for ep in self.episodes]

    def _record(self, ep: _Episode, out: Any, cap: int, gen_s: float, stop_set: set[int]) -> dict[str, Any] | None:
        """Append a generated turn to the episode and parse it: the assistant message to send, or None when the
        turn ended the episode (context limit, malformed call, parser bug)."""
        t, template = ep.traj, self.template
        t.timings["generate_s"] += gen_s
        toks, lps = [int(x) for x in out.token_ids[:cap]], [float(x) for x in out.logprobs[:cap]]
        if self.capture_routing:
            _add_routing(ep, out.routed_experts, len(t.token_ids) + len(toks) - 1)
        t.append_turn(toks, lps, list(out.token_versions[:cap]))
        ended_by_stop = bool(toks) and toks[-1] in stop_set
        if not ended_by_stop and len(t.token_ids) >= self.limits.max_total_tokens:
            _finish(ep, SampleStatus.AGENT_CONTEXT_LIMIT)
            return None
        ep.turn_end = toks[-1] if ended_by_stop else None
        try:
            text = template.decode(toks[:-1] if ended_by_stop else toks)
            message = template.parse_assistant(text, ep.tools or None, call_id_start=ep.num_calls)
        except ToolCallParseError as e:
            logger.debug(
                "env session %s (%s #%d) turn %d: agent validation failed: %s",
                ep.session_id, t.task, t.index, t.num_turns, e,
            )
            _finish(ep, SampleStatus.AGENT_VALIDATION_FAILED, 0.0, {"validation_error": 1.0}, error=str(e))
            return None
        except Exception as e:  # noqa: BLE001 - a parser bug must cost one episode, never the batch
            # the parsers promise ToolCallParseError only; anything else is a bug there, so log it loudly
            logger.exception(
                "env session %s (%s #%d) turn %d: the tool-call parser raised %s; ending this episode",
                ep.session_id, t.task, t.index, t.num_turns, type(e).__name__,
            )
            _finish(ep, INTERNAL_ERROR, error=f"the tool-call parser failed: {_shorten_repr(e)}")
            return None
        ep.num_calls += len(message["tool_calls"])
        if not message["tool_calls"]:
            del message["tool_calls"]  # a final answer: a plain assistant message
        return message
