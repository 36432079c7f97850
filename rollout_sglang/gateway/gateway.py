"""The gateway's core without HTTP: sessions, completions sampled through the engines, the environment link.

:class:`Gateway` turns one Chat Completions request into one turn of a session's token-exact trajectory
(:mod:`~rollout_sglang.gateway.session`): it plans the tokens the request appends, samples the turn
through the version pool (one routed request: the cross-policy draw picks the version, the router keeps
the session on its engine) or an engine, records the tokens, the engine's log-probs and the version
exactly as the agent loop does, and parses the turn with the chat template's tool-call parser.

Decisions an agent sees:

* **A turn whose tool call does not parse** is returned as a plain reply: the raw text as ``content``,
  no ``tool_calls``, ``finish_reason`` "stop" (or "length"). The sampled tokens stay in the trajectory and
  the session counts ``tool_parse_errors``; the agent decides what follows (sent on to a task, a reply
  without calls ends the episode as the built-in loop's malformed call does). A 4xx would discard a turn
  the policy did sample and turn its mistake into an agent crash.
* **tool_choice** ``required`` / named force the start of a call as tokens with loss mask 0 (the chat
  format's ``call_prefix``: ``<tool_call>\\n`` or the call's head up to its arguments, after an empty think
  block for Qwen3; GLM-4: the name line, so ``required`` needs a single tool; GLM-4.5: an empty think block,
  then ``<tool_call>`` and the name);
  the engine samples the rest. ``none`` parses nothing. The tools are always in the prompt, so the choice
  never changes it.
* **Reasoning** (Qwen3's and GLM-4.5's ``<think>`` block) comes back as the message's ``reasoning_content``, out of
  its ``content``; the trajectory keeps the turn as sampled.
* **Stop strings** cut the turn after the first token that completes one; the tokens sampled past it are
  dropped (the kept ones are exactly what was sampled), the text ends before it.
* **Limits** (``max_turns`` completions, ``max_total_tokens`` per segment) end the episode with the agent
  loop's statuses ("task limit reached", "agent context limit") and refuse the request with a 400
  (``turn_limit_reached``, ``context_length_exceeded``).
* With ``enforce_sampling`` (training) a ``temperature`` or ``top_p`` other than the run's is refused:
  the trainer scores every token at the run's temperature.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from env_controller.protocol import MalformedMessageError, SampleStatus, validate_assistant_messages
from rollout_sglang.chat_template import AnyChatTemplate
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeOptions
from rollout_sglang.gateway.options import GatewayOptions
from rollout_sglang.gateway.session import GatewaySession, Plan, Turn
from rollout_sglang.gateway.turn import (
    ApiError,
    Completion,
    TurnRequest,
    bad,
    message_key,
    retry_after_headers,
    tools_key,
)
from rollout_sglang.tool_parser import ToolCallParseError
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)

#: Status of an episode whose agent function raised (or ran past its time limit).
AGENT_ERROR = "agent error"
#: forced prefixes (a tool call's head, by tool name) whose tokens are kept
PREFIX_CACHE = 1024


@dataclass
class GatewayStats:
    """Counters since the gateway started: sessions opened, completions, history rewrites, tool-call parse
    errors, episodes ended by the turn or context limit, engine failures, turns refused with 429 per reason
    (``throttled``), and the turns waiting for the engine now (``queue_depth``) and at most."""

    sessions_opened: int = 0
    completions: int = 0
    history_rewrites: int = 0
    tool_parse_errors: int = 0
    turn_limits: int = 0
    context_limits: int = 0
    engine_errors: int = 0
    throttled: dict[str, int] = dataclasses.field(default_factory=dict)
    queue_depth: int = 0
    queue_depth_max: int = 0

    def count_throttled(self, reason: str) -> None:
        """Count one 429 for ``reason`` ("rollout_ahead", "engines_busy", "queue_full")."""
        self.throttled[reason] = self.throttled.get(reason, 0) + 1


class EnvStartError(RuntimeError):
    """The environment could not start the session's task (unreachable, failed); the message says why."""


def _bytes_to_unicode() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), as character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_OF = _bytes_to_unicode()


class Gateway:
    """Sessions of OpenAI-style agents over an engine or a version pool (see the module doc).

    engine: a VersionPool (each completion routed by its cross-policy and router) or one Engine.
    template: the chat format.
    sampling: the defaults of every turn: ``max_new_tokens`` (a cap: a request may ask for fewer),
        ``temperature``, ``top_p``, ``top_k``; the template's stop tokens are always added.
    episode: the limits of a session (``max_turns`` completions, ``max_total_tokens`` tokens per segment), the
        limit on each environment call, and ``capture_routing`` (MoE models: each turn asks the engine for the
        routed experts of the positions its segment does not hold yet, and the segments' trajectories carry
        them, ``Trajectory.routed_experts``).
    options: sessions open at once, the idle time after which :meth:`reap_idle` cancels a session (not those of
        the trainer's agent runner), backpressure (``max_queued_turns``, ``retry_after_s``: see the module doc),
        and where the :class:`~rollout_sglang.gateway.server.GatewayServer` of this gateway listens.
    env: an EnvClient for sessions opened with a task (None: none).
    enforce_sampling: refuse a temperature or top_p other than ``sampling``'s (training).
    admission: backpressure's hook: the reason a new turn should wait (the rollout ahead of training), or None.

    :attr:`model_name` is the model id ``/models`` lists (set it to serve another name).
    """

    #: the model id ``/models`` lists unless :attr:`model_name` is set
    MODEL_NAME = "agentrl-policy"

    def __init__(self, engine: Any, template: AnyChatTemplate, sampling: SamplingParams, episode: EpisodeOptions,
                 options: GatewayOptions | None = None, *, env: Any = None, enforce_sampling: bool = False,
                 admission: Callable[[], str | None] | None = None) -> None:
        if sampling.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={sampling.max_new_tokens} must be >= 1")
        self.engine = engine
        self.pool = engine if isinstance(engine, VersionPool) else None
        self.template = template
        self.env = env
        self.sampling = sampling
        self.stop_ids = list(dict.fromkeys(list(sampling.stop_token_ids) + list(template.stop_token_ids)))
        self._stop_set = set(self.stop_ids)
        self.options = options if options is not None else GatewayOptions()
        self.max_turns = episode.limits.max_turns
        self.max_total_tokens = episode.limits.max_total_tokens
        self.env_timeout_s = float(episode.env_timeout_s)
        self.capture_routing = bool(episode.capture_routing)
        self.enforce_sampling = enforce_sampling
        self.max_sessions = self.options.max_sessions
        self.session_idle_timeout_s = float(self.options.session_idle_timeout_s)
        self.max_queued_turns = self.options.max_queued_turns
        self.retry_after_s = float(self.options.retry_after_s)
        self.model_name = self.MODEL_NAME
        self.created = int(time.time())
        self.sessions: dict[str, GatewaySession] = {}
        self.stats = GatewayStats()
        # the forced prefixes' tokens by text; keyed by what agents send (tool names), so bounded
        self._encode_prefix = functools.lru_cache(maxsize=PREFIX_CACHE)(self._encode)
        self.admission = admission

    # ------------------------------------------------------------------ sessions
    def authorize(self, session_id: str, key: str | None) -> GatewaySession:
        """The session ``session_id`` when ``key`` is its API key; ApiError 401 without a key, 403 with another
        session's key or an unknown one, 404 for an unknown session."""
        s = self.session(session_id)
        if not key:
            raise ApiError(401, f"session {s.id} needs its API key (the api_key POST /sessions returned): send it "
                                "as 'Authorization: Bearer <key>' or 'x-api-key: <key>' (the SDKs' api_key)",
                           code="missing_api_key")
        if not hmac.compare_digest(key.encode(), s.api_key.encode()):
            raise ApiError(403, f"this API key is not session {s.id}'s: each session has its own key (the api_key "
                                "POST /sessions returned for it)", code="invalid_api_key")
        return s

    def session(self, session_id: str) -> GatewaySession:
        """The open session ``session_id``; ApiError 404 naming it otherwise."""
        s = self.sessions.get(session_id)
        if s is None:
            raise ApiError(404, f"unknown session {session_id!r:.80}: it was never opened here, or it was deleted "
                                f"(open sessions: {len(self.sessions)})", param="session_id",
                           code="session_not_found")
        return s

    @staticmethod
    def _check_running(s: GatewaySession) -> None:
        if not s.running:
            raise ApiError(409, f"session {s.id} has ended (status {s.status!r}); open a new session for another "
                                "episode", code="session_ended")

    async def open_session(self, task: str | None = None, index: int = 0, group_id: int = 0,
                           metadata: dict[str, Any] | None = None, *, owned: bool = False, seed: int | None = None,
                           seed_stride: int = 1) -> GatewaySession:
        """Open a session; with ``task``, start its episode ``index`` in the environment first (the session then
        holds the env's first ``messages`` and ``tools``; an env that ends it at once leaves it ended).

        Raises ApiError 429 at ``max_sessions``, 400 for a task without an environment or an unknown task or
        index, EnvStartError when the environment fails.
        """
        if len(self.sessions) >= self.max_sessions:
            raise ApiError(429, f"{len(self.sessions)} sessions are open (limit {self.max_sessions}); DELETE the "
                                "finished ones", code="too_many_sessions")
        s = GatewaySession(secrets.token_hex(8), task=task or "", index=index, group_id=group_id, metadata=metadata,
                           owned=owned, seed=seed, seed_stride=seed_stride)
        if task is not None:
            if self.env is None:
                raise bad("task", "this gateway has no environment to start tasks in; open the session without one")
            t0 = time.perf_counter()
            # a start may wait out a restarting controller (bounded by the client) on top of the call itself
            limit = self.env_timeout_s + float(getattr(self.env, "start_wait_s", 0.0) or 0.0)
            try:
                s.env_session, reply = await asyncio.wait_for(self.env.start_sample(task, index), limit)
            except ValueError as e:
                raise bad("task", f"the environment cannot start task {task!r:.80} index {index}: {e}") from None
            except Exception as e:  # noqa: BLE001 - any env failure is this request's, reported to it
                what = f"timed out after {limit:.1f}s" if isinstance(e, TimeoutError) else repr(e)
                raise EnvStartError(f"start_sample({task!r}, {index}) {what}") from e
            finally:
                s.timings["env_s"] += time.perf_counter() - t0
            s.first_messages, s.tools = list(reply.messages), list(reply.tools or [])
            if reply.finish:  # the env closed its side already
                s.env_session = None
                s.end(reply.status.value, reply.reward, reply.metrics)
        self.sessions[s.id] = s
        self.stats.sessions_opened += 1
        return s

    async def _release_env(self, s: GatewaySession) -> None:
        """Cancel the session's env episode when it is still open (best effort, logged)."""
        env_session, s.env_session = s.env_session, None
        if env_session is None or self.env is None:
            return
        try:
            await asyncio.wait_for(self.env.cancel(env_session), self.env_timeout_s)
        except Exception as e:  # noqa: BLE001 - the episode is over either way
            logger.warning("cancel of env session %s (gateway session %s) failed: %r", env_session, s.id, e)

    async def end_session(self, s: GatewaySession, status: str, reward: float = 0.0,
                          metrics: dict[str, float] | None = None, error: str = "") -> None:
        """End the episode (a no-op when it ended already) and close its env episode."""
        s.end(status, reward, metrics, error)
        if self.pool is not None:
            self.pool.forget([s.key])
        await self._release_env(s)

    async def set_reward(self, session_id: str, reward: float, metrics: dict[str, float] | None = None) -> None:
        """End the episode as "completed" with ``reward``; ApiError 409 when it ended already."""
        s = self.session(session_id)
        async with s.lock:
            self._check_running(s)
            await self.end_session(s, SampleStatus.COMPLETED.value, reward, metrics)

    async def delete(self, session_id: str) -> GatewaySession:
        """Cancel the session when it runs, and forget it (ApiError 404 when unknown)."""
        s = self.session(session_id)
        del self.sessions[session_id]
        await self.end_session(s, SampleStatus.CANCELLED.value)
        return s

    async def release(self, s: GatewaySession) -> list[Trajectory]:
        """Forget a session of the agent runner and return its trajectories (one per segment); a session still
        running is cancelled first."""
        self.sessions.pop(s.id, None)
        await self.end_session(s, SampleStatus.CANCELLED.value)
        return s.to_trajectories()

    async def reap_idle(self) -> int:
        """Cancel and forget sessions (not the agent runner's) idle longer than ``session_idle_timeout_s``."""
        cutoff = time.monotonic() - self.session_idle_timeout_s
        idle = [s for s in self.sessions.values() if not s.owned and s.last_active < cutoff and not s.lock.locked()]
        for s in idle:
            self.sessions.pop(s.id, None)
            await self.end_session(s, SampleStatus.CANCELLED.value, error="idle too long")
        if idle:
            logger.info("cancelled %d gateway sessions idle for more than %.0fs", len(idle),
                        self.session_idle_timeout_s)
        return len(idle)

    async def aclose(self) -> None:
        """Cancel every session (their env episodes end)."""
        for sid in list(self.sessions):
            s = self.sessions.pop(sid)
            await self.end_session(s, SampleStatus.CANCELLED.value)

    # ------------------------------------------------------------------ completions
    def _params(self, req: TurnRequest, s: GatewaySession) -> SamplingParams:
        base = self.sampling
        for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k)):
            ours = getattr(base, name)
            if name == "top_k" and value is not None and value != ours and not (ours < 1 and value < 1):
                raise bad(name, f"is {value} but this gateway samples with top_k={ours} (-1: none) and a turn cannot "
                                "change it (the trainer scores every token with the run's sampling); leave top_k out",
                          code="unsupported_value")
            if self.enforce_sampling and value is not None and abs(value - ours) > 1e-9:
                raise bad(name, f"is {value} but this gateway samples for training at {name}={ours} (the trainer "
                                f"scores every token at it); leave {name} out or set it to {ours}",
                          code="unsupported_value")
        return SamplingParams(
            max_new_tokens=base.max_new_tokens if req.max_tokens is None else min(req.max_tokens, base.max_new_tokens),
            temperature=base.temperature if req.temperature is None else req.temperature,
            top_p=base.top_p if req.top_p is None else req.top_p, top_k=base.top_k, stop_token_ids=self.stop_ids,
            seed=req.seed if req.seed is not None else s.turn_seed())

    def _forced_prefix(self, req: TurnRequest) -> list[int]:
        """The tokens ``tool_choice`` forces before sampling (the call's head; an empty think block for ``no_think``
        in a reasoning format; empty otherwise)."""
        if req.tool_choice not in ("required", "function"):
            return self._no_think_prefix() if req.no_think else []
        name = req.forced_tool
        if name is None and self.template.call_prefix(None) is None:
            # the format cannot start "some call": its calls start with the tool's name
            if len(req.tools) != 1:
                raise bad("tool_choice", f"'required' with several tools cannot be forced in the "
                                         f"{self.template.name} chat format (a call starts with the tool's name); "
                                         "name the tool or use 'auto'")
            name = req.tools[0]["function"]["name"]
        return list(self._encode_prefix(self.template.call_prefix(name) or ""))

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.template.tokenizer.encode(text, add_special_tokens=False))

    def _no_think_prefix(self) -> list[int]:
        """The empty think block a turn that must not reason starts with (forced, loss mask 0); none when the
        format does not reason or its prompts already end with one; ApiError 400 when it has no such block."""
        t = self.template
        if getattr(t, "reasoning_splitter", None) is None or getattr(t, "enable_thinking", True) is False:
            return []
        text = getattr(t, "NO_THINKING", None)
        if text is None:
            raise bad("thinking", f"cannot be turned off in the {t.name} chat format (the policy reasons in every "
                                  "turn, and no empty think block is defined for it); leave thinking out",
                      code="unsupported_value")
        return list(self._encode_prefix(text))

    async def _generate(self, s: GatewaySession, prompt: list[int], params: SamplingParams,
                        routing_from: int | None) -> GenerationOutput:
        routing = {} if routing_from is None else {"routing_from": [routing_from]}
        if self.pool is not None:
            return (await self.pool.generate([prompt], params, keys=[s.key], **routing))[0]
        return (await self.engine.generate([prompt], params, **routing))[0]

    async def complete(self, session_id: str, req: TurnRequest,
                       on_ready: Callable[[], Awaitable[None]] | None = None) -> Completion:
        """Sample one turn for ``req`` in session ``session_id`` and record it.

        ``on_ready`` is awaited once the request is accepted, before the engine runs (a stream's first
        chunk). Raises ApiError: 404 unknown session, 409 ended, 400 a request it cannot honour (the
        limits end the episode first), 503 when the engine fails (the session is left as it was).
        """
        s = self.session(session_id)
        async with s.lock:
            self._check_running(s)
            s.last_active = time.monotonic()
            params = self._params(req, s)
            prefix = self._forced_prefix(req)
            try:
                plan = s.plan(self.template, req.messages, [message_key(m) for m in req.messages], req.tools,
                              tools_key(req.tools), prefix)
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # the template's refusal of a message
                raise bad("messages", f"cannot be rendered in the {self.template.name} chat format: {e}") from None
            if len(s.turns) >= self.max_turns:
                self.stats.turn_limits += 1
                await self.end_session(s, SampleStatus.TASK_LIMIT_REACHED.value)
                raise ApiError(400, f"session {s.id} used its {self.max_turns} completions (rollout.max_turns); the "
                                    "episode ended with 'task limit reached'", code="turn_limit_reached")
            room = self.max_total_tokens - len(plan.prompt)
            if room < 1:
                self.stats.context_limits += 1
                await self.end_session(s, SampleStatus.AGENT_CONTEXT_LIMIT.value)
                raise ApiError(400, f"the conversation is {len(plan.prompt)} tokens, which leaves no room under "
                                    f"max_total_tokens={self.max_total_tokens}; the episode ended with 'agent context "
                                    "limit'", param="messages", code="context_length_exceeded")
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
            if not s.owned:
                self._check_backpressure()
            if on_ready is not None:
                await on_ready()
            t0 = time.perf_counter()
            st = self.stats
            st.queue_depth += 1
            st.queue_depth_max = max(st.queue_depth_max, st.queue_depth)
            try:
                out = await self._generate(s, plan.prompt, params,
                                           s.routing_from(plan) if self.capture_routing else None)
            except (asyncio.CancelledError, ApiError):
                raise
            except Exception as e:  # noqa: BLE001 - reported to the client; the session stays as it was
                self.stats.engine_errors += 1
                logger.error("gateway session %s: the engine failed: %r", s.id, e)
                raise ApiError(503, f"the engine failed: {e!r:.300}", code="engine_error") from e
            finally:
                st.queue_depth -= 1
            engine_s = time.perf_counter() - t0
            s.timings["generate_s"] += engine_s
            return self._record(s, req, plan, out, params.max_new_tokens, engine_s)

    def _check_backpressure(self) -> None:
        """ApiError 429 with ``Retry-After`` when a new turn should wait instead of queuing: the rollout is ahead
        of training beyond its staleness budget (``admission``), no slot of the version pool can serve (every one
        updating or out of rotation), or ``max_queued_turns`` turns are in the engine already. The trainer's own
        sessions (the agent runner's) are never refused: the rollout manager admitted their groups."""
        reason = self.admission() if self.admission is not None else None
        if reason is not None:
            code, msg = "rollout_ahead", f"the rollout is ahead of training: {reason}"
        elif self.pool is not None and self.pool.latest_version < 0:
            code, msg = "engines_busy", (f"no engine can serve now ({self.pool.slot_states()}): a weight update is "
                                         "running")
        elif self.max_queued_turns and self.stats.queue_depth >= self.max_queued_turns:
            code, msg = "queue_full", (f"{self.stats.queue_depth} turns are waiting for the engines (gateway "
                                       f"max_queued_turns={self.max_queued_turns})")
        else:
            return
        self.stats.count_throttled(code)
        raise ApiError(429, f"{msg}; retry after {self.retry_after_s:g}s", code=code,
                       headers=retry_after_headers(self.retry_after_s))

    def _cut_at_stop(self, toks: list[int], stops: list[str]) -> tuple[int, str, str] | None:
        """``(k, text, stop)``: the fewest tokens whose text holds a stop string, the text before it and the stop
        string; None when the turn holds none."""
        decode = self.template.decode
        if not any(x in decode(toks) for x in stops):
            return None
        lo, hi = 1, len(toks)
        while lo < hi:  # the first prefix that holds a stop string (holding one is monotone in the length)
            mid = (lo + hi) // 2
            if any(x in decode(toks[:mid]) for x in stops):
                hi = mid
            else:
                lo = mid + 1
        text = decode(toks[:lo])
        first = min((x for x in stops if x in text), key=text.index)
        return lo, text[:text.index(first)], first

    def _reply(self, s: GatewaySession, text: str, req: TurnRequest) -> tuple[dict[str, Any], str]:
        """The OpenAI assistant message of a turn's ``text`` and the parse error ("" when none)."""
        reasoning, rest = self.template.split_reasoning(text)
        content, calls, error = rest.strip(), [], ""
        if req.tools and req.tool_choice != "none":
            try:
                parsed = self.template.parse_assistant(text, req.tools, call_id_start=s.num_calls)
                content, calls = parsed["content"], parsed["tool_calls"]
                reasoning = parsed.get("reasoning_content") or ""
            except ToolCallParseError as e:
                content, reasoning, error = text.strip(), "", str(e)
            except Exception as e:  # noqa: BLE001 - the parsers promise ToolCallParseError; a bug costs this turn
                logger.exception("gateway session %s: the tool-call parser raised %s", s.id, type(e).__name__)
                content, reasoning, error = text.strip(), "", f"the tool-call parser failed: {e!r:.300}"
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message, error

    def _record(self, s: GatewaySession, req: TurnRequest, plan: Plan, out: GenerationOutput, cap: int,
                engine_s: float) -> Completion:
        """Commit the sampled turn to the session and build its completion (see the module doc)."""
        toks, lps = list(out.token_ids[:cap]), list(out.logprobs[:cap])
        ended_by_stop = bool(toks) and toks[-1] in self._stop_set
        body = toks[:-1] if ended_by_stop else toks
        cut = self._cut_at_stop(body, req.stop) if req.stop else None
        if cut is not None:
            k, text, _ = cut
            toks, lps, ended_by_stop = toks[:k], lps[:k], False
        else:
            text = self.template.decode(body)
        text = (self.template.decode(plan.prefix) if plan.prefix else "") + text
        message, error = self._reply(s, text, req)
        s.commit(plan, toks, lps, list(out.token_versions[:len(toks)]), toks[-1] if ended_by_stop else None,
                 message_key(message), out.routed_experts, self.capture_routing)
        if plan.rewrite:
            self.stats.history_rewrites += 1
            logger.debug("gateway session %s: history rewrite, segment %d starts", s.id, len(s.segments) - 1)
        if error:
            s.tool_parse_errors += 1
            self.stats.tool_parse_errors += 1
            logger.debug("gateway session %s: tool call did not parse: %s", s.id, error)
        calls = message.get("tool_calls") or []
        s.num_calls += len(calls)
        s.last_reply = message
        finish = ("tool_calls" if calls else "stop") if ended_by_stop or cut is not None else "length"
        s.turns.append(Turn(len(s.segments) - 1, int(out.version), finish, len(plan.prompt), len(toks), len(calls),
                            error))
        seg = s.current
        s.context_full = finish == "length" and seg is not None and len(seg.token_ids) >= self.max_total_tokens
        self.stats.completions += 1
        return Completion(message=message, finish_reason=finish, prompt_tokens=len(plan.prompt),
                          completion_tokens=len(toks), token_ids=toks, logprobs=lps, version=int(out.version),
                          engine_s=engine_s, stop_sequence=cut[2] if cut is not None else None)

    def token_pieces(self, token_ids: list[int]) -> list[tuple[str, bytes]]:
        """``(text, bytes)`` of each token, for ``logprobs`` (bytes exact for byte-level BPE vocabularies)."""
        tok = self.template.tokenizer
        out = []
        for t, piece in zip(token_ids, tok.convert_ids_to_tokens(token_ids)):
            text = tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            raw = bytes(_BYTE_OF[c] for c in piece) if piece and all(c in _BYTE_OF for c in piece) else text.encode()
            out.append((text, raw))
        return out

    # ------------------------------------------------------------------ environment
    async def env_step(self, session_id: str, message: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send an assistant message (default: the last reply) to the session's task; returns the env's reply
        (``{messages, tools, status, finish, reward, metrics}``, plus ``error`` for a failed env call).

        A reply with ``finish`` ends the episode with the env's status and reward; so do the turn limit
        ("task limit reached"), a last turn cut at the context limit ("agent context limit") and a failed or
        timed-out env call ("task error"), each answered with a finished reply. ApiError 400 for a session
        without a task or a malformed message, 409 once it ended.
        """
        s = self.session(session_id)
        async with s.lock:
            self._check_running(s)
            s.last_active = time.monotonic()
            if s.env_session is None:
                raise bad("task", f"session {s.id} was opened without a task: there is no environment to send "
                                  "the message to; end the episode with POST /sessions/<id>/reward")
            if message is None:
                if s.last_reply is None:
                    raise bad("messages", "no completion yet: there is no reply to send; pass messages: "
                                          "[assistant message]")
                message = s.last_reply
            try:
                msg = validate_assistant_messages([message])
            except MalformedMessageError as e:
                raise bad("messages", str(e)) from None
            if s.context_full:
                self.stats.context_limits += 1
                await self.end_session(s, SampleStatus.AGENT_CONTEXT_LIMIT.value)
                return _finished(s)
            t0 = time.perf_counter()
            try:
                reply = await asyncio.wait_for(self.env.interact(s.env_session, [msg]), self.env_timeout_s)
            except Exception as e:  # noqa: BLE001 - an env failure ends this episode, as in the agent loop
                what = f"timed out after {self.env_timeout_s:.1f}s" if isinstance(e, TimeoutError) else f"failed: {e!r}"
                logger.error("interact on env session %s (gateway session %s) %s", s.env_session, s.id, what)
                await self.end_session(s, SampleStatus.TASK_ERROR.value, error=f"interact {what}")
                return {**_finished(s), "error": s.error}
            finally:
                s.timings["env_s"] += time.perf_counter() - t0
            if reply.finish:
                s.env_session = None
                await self.end_session(s, reply.status.value, reply.reward, reply.metrics)
                return reply.to_json()
            if len(s.turns) >= self.max_turns:
                self.stats.turn_limits += 1
                await self.end_session(s, SampleStatus.TASK_LIMIT_REACHED.value)
                return _finished(s)
            return reply.to_json()


def _finished(s: GatewaySession) -> dict[str, Any]:
    """The env-style reply that tells an agent its episode ended (no new messages)."""
    return {"messages": [], "tools": [], "status": s.status, "finish": True, "reward": s.reward,
            "metrics": dict(s.metrics)}
