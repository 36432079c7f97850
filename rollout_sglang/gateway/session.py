"""One gateway session: the token-exact state of an agent's episode, cut into segments at history rewrites.

A segment is one token sequence laid out like the agent loop's: the prompt (``encode_prompt``), then per
completion the env-reply piece of the messages that are new since the previous request
(``encode_env_reply``, after the stop token that ended the previous turn), any forced tokens
(``tool_choice`` required or named), and the sampled turn exactly as the engine returned it. Only the
sampled tokens have ``loss_mask`` 1 and a log-prob.

A request extends the segment when its tools are the segment's and its messages start with every
message the segment holds (the previous request's messages plus the reply the gateway returned),
compared by :func:`~rollout_sglang.gateway.openai_format.message_key`. Anything else (a dropped, edited,
reordered or re-sent message, other tools) is a history rewrite: the segment is kept as it is, and a new
one starts from the request's messages. Nothing is ever re-tokenized.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_sglang.trajectory import SampledTokens, Trajectory

#: The status of a session whose episode has not ended.
RUNNING = "running"


@dataclass
class Segment(SampledTokens):
    """One trajectory piece: tokens, loss mask, log-probs, each token's version (-1: not sampled), the sampled
    turns' spans.

    keys: the message keys of the conversation the tokens encode (the last is the returned reply);
    tools_key: its tool list; turn_end: the stop token that ended the last turn (None: it was cut).
    routing: with routing capture, the routed experts of positions ``[0, routed)`` in pieces (one per turn);
    routing_lost: a turn came back without them (the segment then carries none).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    keys: list[tuple] = field(default_factory=list)
    tools_key: str = ""
    turn_end: int | None = None
    routing: list[np.ndarray] = field(default_factory=list)
    routed: int = 0
    routing_lost: bool = False

    def to_json(self) -> dict[str, Any]:
        """``{token_ids, loss_mask, logprobs, versions, turn_spans}``."""
        return {"token_ids": self.token_ids, "loss_mask": self.loss_mask, "logprobs": self.behavior_logprobs,
                "versions": self.versions, "turn_spans": [list(s) for s in self.turn_spans]}


@dataclass
class Plan:
    """What one completion appends before the engine samples.

    new_segment: the request starts a segment (the first request, or a history rewrite: ``rewrite``);
    piece: the prompt of a new segment, or the env-reply piece; prefix: forced tokens (loss mask 0);
    prompt: every token the engine continues; keys, tools_key: the request's messages and tools.
    """

    new_segment: bool
    rewrite: bool
    piece: list[int]
    prefix: list[int]
    prompt: list[int]
    keys: list[tuple]
    tools_key: str


@dataclass
class Turn:
    """One sampled turn, for the trajectory view: its segment, version, finish reason, token counts,
    tool calls and the tool-call parse error ("" when it parsed)."""

    segment: int
    version: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: int
    parse_error: str = ""


class GatewaySession:
    """An agent's episode behind one base URL: its segments, status, reward and environment link.

    task, index, group_id, metadata: what it was opened with (task "" when none); owned: opened by the
    trainer's agent runner (never reaped as idle); seed: base sampling seed of its turns (None: unseeded),
    turn ``k`` uses ``seed + k * seed_stride``; key: its router key in the version pool; api_key: the credential
    of its base URL (no other session's works there).
    """

    def __init__(self, session_id: str, *, task: str = "", index: int = 0, group_id: int = 0,
                 metadata: dict[str, Any] | None = None, owned: bool = False, seed: int | None = None,
                 seed_stride: int = 1) -> None:
        self.id = session_id
        self.api_key = "sk-agentrl-" + secrets.token_hex(16)
        # Responses API: response id -> the conversation it ended (without instructions), for previous_response_id
        self.responses: dict[str, list[dict[str, Any]]] = {}
        self.task, self.index, self.group_id = task, int(index), int(group_id)
        self.metadata = dict(metadata or {})
        self.owned = owned
        self.seed, self.seed_stride = seed, max(1, int(seed_stride))
        self.key = ("gateway", session_id)
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []
        self.num_calls = 0
        self.history_rewrites = 0
        self.tool_parse_errors = 0
        self.status = RUNNING
        self.reward = 0.0
        self.metrics: dict[str, float] = {}
        self.error = ""
        self.env_session: str | None = None
        self.first_messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.last_reply: dict[str, Any] | None = None
        self.context_full = False  # the last turn was cut with the segment at max_total_tokens
        self.timings = {"generate_s": 0.0, "env_s": 0.0}
        self.lock = asyncio.Lock()
        self.last_active = time.monotonic()

    @property
    def running(self) -> bool:
        """Whether the episode has not ended."""
        return self.status == RUNNING

    @property
    def current(self) -> Segment | None:
        """The segment the next completion may extend (None before the first completion)."""
        return self.segments[-1] if self.segments else None

    def turn_seed(self) -> int | None:
        """The sampling seed of the next turn (None: unseeded)."""
        return None if self.seed is None else self.seed + len(self.turns) * self.seed_stride

    def plan(self, template: Any, messages: list[dict[str, Any]], keys: list[tuple], tools: list[dict[str, Any]],
             tools_key: str, prefix: list[int]) -> Plan:
        """The tokens a completion of ``messages`` (with ``keys``) and ``tools`` appends (see the module doc).

        Raises ValueError (from the template) when a message cannot be rendered.
        """
        seg = self.current
        if seg is not None and tools_key == seg.tools_key and keys[:len(seg.keys)] == seg.keys:
            piece = template.encode_env_reply(messages[len(seg.keys):], ended_with=seg.turn_end)
            return Plan(False, False, piece, prefix, seg.token_ids + piece + prefix, keys, tools_key)
        piece = template.encode_prompt(messages, tools or None)
        return Plan(True, seg is not None, piece, prefix, piece + prefix, keys, tools_key)

    def routing_from(self, plan: Plan) -> int:
        """The first position of ``plan``'s prompt whose routed experts its segment does not hold yet."""
        return 0 if plan.new_segment or self.current is None else self.current.routed

    def commit(self, plan: Plan, tokens: list[int], logprobs: list[float], versions: list[int], turn_end: int | None,
               reply_key: tuple, routed_experts: np.ndarray | None = None, capture: bool = False) -> tuple[int, int]:
        """Append a sampled turn after ``plan``'s tokens (``versions``: each token's); returns its span ``(start,
        end)`` in its segment.

        With ``capture``, ``routed_experts`` are the engine's from :meth:`routing_from` on; the rows up to the
        turn's last kept token are kept (None: the segment loses its routing)."""
        if plan.new_segment:
            self.segments.append(Segment(tools_key=plan.tools_key))
            self.history_rewrites += int(plan.rewrite)
        seg = self.segments[-1]
        seg.append_context(plan.piece)
        seg.append_context(plan.prefix)
        start, end = seg.append_turn(list(tokens), list(logprobs), list(versions))
        seg.keys = plan.keys + [reply_key]
        seg.turn_end = turn_end
        if capture:
            need = len(seg.token_ids) - 1 - seg.routed
            if routed_experts is None or len(routed_experts) < need:
                seg.routing_lost = True
            elif need > 0:
                seg.routing.append(routed_experts[:need])
                seg.routed += need
        return start, end

    def end(self, status: str, reward: float = 0.0, metrics: dict[str, float] | None = None, error: str = "") -> None:
        """End the episode with ``status`` (a no-op once it ended)."""
        if not self.running:
            return
        self.status, self.reward, self.error = str(status), float(reward), error
        if metrics:
            self.metrics.update({k: float(v) for k, v in metrics.items()})

    def _metrics(self) -> dict[str, float]:
        out = dict(self.metrics)
        if self.history_rewrites:
            out["history_rewrites"] = float(self.history_rewrites)
        if self.tool_parse_errors:
            out["tool_parse_errors"] = float(self.tool_parse_errors)
        return out

    def to_trajectories(self) -> list[Trajectory]:
        """One Trajectory per segment (one empty Trajectory when nothing was sampled), each with the episode's
        task, group, reward, status, metrics, timings and error."""
        segments = self.segments or [Segment()]
        return [Trajectory(token_ids=list(s.token_ids), loss_mask=list(s.loss_mask),
                           behavior_logprobs=list(s.behavior_logprobs), versions=list(s.versions),
                           turn_spans=list(s.turn_spans), task=self.task, index=self.index, group_id=self.group_id,
                           reward=self.reward, status=self.status, metrics=self._metrics(),
                           timings=dict(self.timings), error=self.error,
                           routed_experts=np.concatenate(s.routing) if s.routing and not s.routing_lost else None)
                for s in segments]

    def to_json(self) -> dict[str, Any]:
        """The trajectory view: the current segment's arrays at the top level, every segment under ``segments``,
        the episode's outcome, and one record per sampled turn."""
        seg = self.current or Segment()
        return {
            "session_id": self.id, "task": self.task or None, "index": self.index, "group_id": self.group_id,
            "metadata": self.metadata, **seg.to_json(), "reward": self.reward, "status": self.status,
            "metrics": self._metrics(), "error": self.error, "history_rewrites": self.history_rewrites,
            "segments": [s.to_json() for s in self.segments], "turns": [t.__dict__ for t in self.turns],
        }
