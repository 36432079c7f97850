"""Training with user agents: every sample of a group is one call of the user's agent function on a gateway
session, and comes back as the session's trajectories.

``fn(client: openai.AsyncOpenAI, sample: dict) -> float | None`` gets a client already pointed at a fresh
session's base URL and ``sample`` = ``{task, index, group_id, session_id, base_url, anthropic_base_url,
api_key, model, messages, tools}`` (``messages`` and ``tools``: what the environment opened the episode with;
``api_key``: the session's own key, for a framework's client of its own: an ``anthropic.AsyncAnthropic`` on
``anthropic_base_url``, or an OpenAI Agents SDK / smolagents model on ``base_url``). Its completions are
the episode's turns; ``client.post("/env", body={"messages": [reply]}, cast_to=object)`` sends a reply to
the task's environment. Returning a number ends the episode with that reward ("completed"); returning
None leaves the ending to the environment (an episode it did not end is cancelled, reward 0). An episode
that the environment or a limit ended keeps that ending whatever the function does next.

A function that raises ends its episode with status "agent error", reward 0, ``metrics["agent_error"]``
1 and the exception's last traceback line as the trajectory's ``error`` (metrics hold numbers only); one
that runs past ``agent_timeout_s`` is cancelled and ends the same way. Neither stops the run.
"""
from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from env_controller.protocol import SampleStatus
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.gateway.gateway import AGENT_ERROR, EnvStartError, Gateway
from rollout_sglang.gateway.options import AgentRunnerOptions
from rollout_sglang.gateway.server import GatewayServer
from rollout_sglang.gateway.session import GatewaySession
from rollout_sglang.gateway.turn import ApiError
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float | None]]
#: distinct agent errors logged with their traceback (later repeats are counted only)
_LOGGED_ERRORS_MAX = 100


def _shared_http_client(max_connections: int) -> Any:
    """One HTTP connection pool for every episode's OpenAI client: a client of its own costs each episode an SSL
    context, built in CPU time on the rollout's event loop. Its transport is aiohttp's (openai's
    ``DefaultAioHttpClient``): httpx's own pool takes CPU that grows with the requests waiting on it, on the rollout's
    event loop, when thousands of agents wait for their turns at once (docs/BENCHMARKS.md). At most
    ``max_connections`` open, as many as the gateway serves. An agent that closes its client leaves the pool open;
    :meth:`close_pool` closes it."""
    import httpx
    import openai

    class SharedHttpClient(openai.DefaultAioHttpClient):  # type: ignore[misc, valid-type]
        async def aclose(self) -> None:  # what an agent's ``client.close()`` calls
            return None

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedHttpClient(limits=httpx.Limits(max_connections=max_connections,
                                                max_keepalive_connections=max_connections))


class AgentRunner:
    """Runs ``agent_fn`` once per requested episode, each against its own session of ``gateway``, served by a
    :class:`GatewayServer` where the gateway's options say (``host``, ``port``, ``max_connections``; started on the
    first call, on the caller's event loop).

    token: the server's bearer token, for its admin routes (open a session, reward, ...); None: a random one, which no
    agent is given: the runner opens and ends sessions in process, and agents reach only their own session's routes
    with its key, so no agent's code can post its own reward; options: the limit on one call of ``agent_fn``
    (:class:`AgentRunnerOptions`; None: its defaults); client_timeout_s: the OpenAI client's limit on one request.
    """

    def __init__(self, gateway: Gateway, agent_fn: AgentFn, options: AgentRunnerOptions | None = None, *,
                 token: str | None = None, client_timeout_s: float = 600.0) -> None:
        if not client_timeout_s > 0:
            raise ValueError(f"client_timeout_s={client_timeout_s!r} must be > 0 (seconds)")
        self.gateway = gateway
        self.fn = agent_fn
        self.token = token or secrets.token_urlsafe(24)
        self.agent_timeout_s = float((options or AgentRunnerOptions()).agent_timeout_s)
        self.client_timeout_s = float(client_timeout_s)
        self.server = GatewayServer(gateway, token=self.token)
        self.agent_errors = 0
        self._logged: set[str] = set()
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._http: Any = None
        self._reported: dict[str, float] = {}

    async def start(self) -> None:
        """Start the server (once)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if not self._started:
                # the agents' HTTP clients log a line per request at INFO: that would drown the run's log
                for name in ("httpx", "httpx2", "openai"):
                    if logging.getLogger(name).level == logging.NOTSET:
                        logging.getLogger(name).setLevel(logging.WARNING)
                await self.server.start()
                self._http = _shared_http_client(self.gateway.options.max_connections)
                self._started = True

    async def aclose(self) -> None:
        """Cancel the sessions still open and stop the server."""
        await self.gateway.aclose()
        if self._started:
            await self._http.close_pool()
            await self.server.stop()
            self._started = False

    async def run_group(self, requests: list[tuple[str, int, int]], params: SamplingParams) -> list[Trajectory]:
        """One episode per ``(task, index, group_id)``; returns every episode's trajectories (one per segment,
        so possibly more than ``len(requests)``), in request order.

        params: its ``seed`` seeds the turns (episode ``j``, turn ``k``: ``seed + k * len(requests) + j``, as the
        agent loop seeds its turns); the other sampling settings are the gateway's.
        """
        await self.start()
        stride = len(requests)
        episodes = [self._episode(task, index, group_id, None if params.seed is None else params.seed + j, stride)
                    for j, (task, index, group_id) in enumerate(requests)]
        return [t for trajs in await asyncio.gather(*episodes) for t in trajs]

    async def _episode(self, task: str, index: int, group_id: int, seed: int | None, stride: int) -> list[Trajectory]:
        t0 = time.perf_counter()
        try:
            s = await self.gateway.open_session(task, index, group_id, owned=True, seed=seed, seed_stride=stride)
        except (ApiError, EnvStartError) as e:
            logger.error("gateway episode %s #%d: the environment did not start it: %s", task, index, e)
            return [Trajectory([], [], [], [], [], task=task, index=index, group_id=group_id,
                               status=SampleStatus.TASK_ERROR.value, error=f"start_sample failed: {e}",
                               timings={"generate_s": 0.0, "env_s": 0.0, "agent_s": time.perf_counter() - t0})]
        try:
            if s.running:
                await self._call_agent(s)
        finally:
            trajs = await self.gateway.release(s)
        for t in trajs:
            t.timings["agent_s"] = time.perf_counter() - t0
        return trajs

    def sample(self, s: GatewaySession) -> dict[str, Any]:
        """What the agent function gets besides its client."""
        return {"task": s.task, "index": s.index, "group_id": s.group_id, "session_id": s.id,
                "base_url": self.server.base_url(s.id), "anthropic_base_url": self.server.anthropic_base_url(s.id),
                "api_key": s.api_key, "model": self.gateway.model_name,
                "messages": [dict(m) for m in s.first_messages], "tools": [dict(t) for t in s.tools]}

    async def _call_agent(self, s: GatewaySession) -> None:
        from openai import AsyncOpenAI  # only runs that train user agents need the package

        client = AsyncOpenAI(base_url=self.server.base_url(s.id), api_key=s.api_key, max_retries=0,
                             timeout=self.client_timeout_s, http_client=self._http)
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(self.fn(client, self.sample(s)), self.agent_timeout_s)
        except Exception as e:  # noqa: BLE001 - a user's agent failing costs its episode only
            if isinstance(e, TimeoutError) and time.monotonic() - t0 >= self.agent_timeout_s:
                line = f"TimeoutError: the agent function ran past rollout.agent_timeout_s={self.agent_timeout_s:g}s"
            else:
                line = traceback.format_exception_only(type(e), e)[-1].strip()
            await self._failed(s, line, e)
            return
        finally:
            await client.close()
        if result is None:
            if s.running:
                await self.gateway.end_session(s, SampleStatus.CANCELLED.value,
                                               error="the agent function returned None and the environment did not "
                                                     "end the episode")
            return
        try:
            reward = float(result)  # type: ignore[arg-type]
            if not math.isfinite(reward) or isinstance(result, bool):
                raise ValueError
        except (TypeError, ValueError):
            await self._failed(s, f"the agent function returned {result!r:.80}, not a reward (a finite number or "
                                  "None)", None)
            return
        if s.running:
            await self.gateway.end_session(s, SampleStatus.COMPLETED.value, reward)
        else:
            logger.debug("gateway session %s: reward %s returned after the episode ended (%s); kept the ending",
                         s.id, reward, s.status)

    async def _failed(self, s: GatewaySession, line: str, exc: BaseException | None) -> None:
        """End the episode as an agent error (unless it ended already) and log each distinct error once."""
        self.agent_errors += 1
        if line not in self._logged and len(self._logged) < _LOGGED_ERRORS_MAX:
            self._logged.add(line)
            logger.warning("agent function failed on %s #%d (gateway session %s): %s (each distinct error is "
                           "logged once)", s.task, s.index, s.id, line, exc_info=exc)
        await self.gateway.end_session(s, AGENT_ERROR, 0.0, {"agent_error": 1.0}, error=line)

    def metrics(self) -> dict[str, float]:
        """Counts since the previous call: ``gateway/completions``, ``gateway/history_rewrites``,
        ``gateway/tool_parse_errors``, ``gateway/agent_errors``, ``gateway/turn_limits``,
        ``gateway/context_limits``, ``gateway/throttled`` (429s); and ``gateway/queue_depth_max``, the most turns
        waiting for the engines at once since the gateway started."""
        st = self.gateway.stats
        now = {"gateway/completions": st.completions, "gateway/history_rewrites": st.history_rewrites,
               "gateway/tool_parse_errors": st.tool_parse_errors, "gateway/agent_errors": self.agent_errors,
               "gateway/turn_limits": st.turn_limits, "gateway/context_limits": st.context_limits,
               "gateway/throttled": sum(st.throttled.values())}
        out = {k: float(v - self._reported.get(k, 0)) for k, v in now.items()}
        self._reported = {k: float(v) for k, v in now.items()}
        out["gateway/queue_depth_max"] = float(st.queue_depth_max)
        return out
