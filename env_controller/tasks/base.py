"""The API of built-in tasks, and the shared machinery of small function-call tasks.

A :class:`Task` owns a deterministic list of sample indices; ``start(index)`` opens a
:class:`TaskSession` and returns its first :class:`TaskReply` (the user message and the tools);
``session.interact(assistant_message)`` executes the assistant's tool calls and replies with one
``{"role": "tool", "tool_call_id", "content"}`` message per executed call.
``demonstration(index)`` returns the conversation of a scripted expert solving the sample, for a
supervised warm-up; ``careless_demonstration(index)`` that of a low-effort player (when the task
has one), which a warm-up mixes in so that RL has a bad habit to unlearn.

Rules shared by every :class:`ToolTask` (the built-in tasks):

* An assistant message without tool calls ends the episode: status ``agent invalid action``,
  reward 0, no new messages.
* Every executed tool call is one turn, whether it succeeds or not. A call to an unknown tool,
  arguments that are not a JSON object, missing or unexpected argument names, or a value of the
  wrong JSON type gets a tool message starting with ``error:`` that says what was wrong, so the
  agent can recover on its next turn.
* When the turn count reaches the task's ``max_turns`` without the episode finishing, the
  episode ends with status ``task limit reached`` and reward 0.
* An assistant message may carry several tool calls; they run in order, each one a turn, and
  the calls after the one that finishes the episode are ignored (no tool message).
* The reply that finishes an episode carries the tool message of the finishing call, the final
  ``reward`` and ``metrics = {"success": 0.0 | 1.0, "turns": <tool calls executed>}``;
  running replies carry empty metrics.

Each task documents its own reward in its class docstring.
"""
from __future__ import annotations

import json
import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

from env_controller.protocol import SampleStatus, TaskReply
from env_controller.tasks.options import TaskOptions

logger = logging.getLogger(__name__)

Message = dict[str, Any]
ToolSchema = dict[str, Any]
#: A scripted expert: yields ``(tool name, arguments)`` and is sent each call's tool reply content.
Expert = Generator[tuple[str, dict[str, Any]], str, None]


class DemonstrationUnavailable(RuntimeError):
    """A demonstration the infrastructure could not play (a container task's retries spent): the task set is not at
    fault, and another demonstration may be drawn instead."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


class TaskSession(ABC):
    """One running episode of a task."""

    @abstractmethod
    async def interact(self, assistant_message: Message) -> TaskReply:
        """Apply one assistant message and return the environment's reply.

        ``assistant_message`` is ``{"role": "assistant", "content": str, "tool_calls": [{"id",
        "type": "function", "function": {"name", "arguments": <JSON string>}}]}``; the reply's
        messages are ``{"role": "tool", "tool_call_id", "content"}``.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release the session's resources; safe to call more than once."""


class Task(ABC):
    """A built-in task: a deterministic set of samples behind one function-call interface."""

    name: ClassVar[str]

    @abstractmethod
    def indices(self) -> list[int]:
        """All sample indices of this task, in a fixed order (the same for the same params)."""

    @abstractmethod
    async def start(self, index: int) -> tuple[TaskSession, TaskReply]:
        """Open an episode on sample ``index``: the session and its first reply (user message, tools).

        Raises ValueError naming the index when it is not one of :meth:`indices`.
        """

    @abstractmethod
    def demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """A scripted expert's full conversation on sample ``index`` and the task's tools.

        The conversation holds the first reply's messages, then alternating assistant messages
        (with ``tool_calls``) and the environment's tool messages, exactly as replaying the
        assistant messages through a session would produce them, ending with the reply that
        finished the episode.
        """

    def careless_demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]] | None:
        """A low-effort player's conversation on sample ``index`` (it may fail), or None.

        Mixed into the supervised warm-up (``sft.careless_fraction``) so that the warm-up policy
        holds both a good and a bad behaviour and RL has to find from reward which one pays.
        Tasks without such a player return None (the default).
        """
        return None


# ---------------------------------------------------------------------------------------------
# helpers


def function_schema(name: str, description: str, params: dict[str, str]) -> ToolSchema:
    """An OpenAI function schema with all ``params`` (name -> JSON type) required."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": t} for p, t in params.items()},
                "required": list(params),
            },
        },
    }


def make_tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> Message:
    """One OpenAI tool call entry ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "array"
    return "object"


def validate_arguments(schema: ToolSchema, raw_arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Parse and check a tool call's arguments against its function schema.

    Returns ``(arguments, None)`` when valid, else ``(None, error text)`` where the text names the
    tool, the bad argument and what was expected. ``raw_arguments`` is the JSON string of the call
    (a dict is accepted as already parsed).
    """
    fn = schema["function"]
    name = fn["name"]
    props: dict[str, dict[str, Any]] = fn["parameters"].get("properties", {})
    required: list[str] = fn["parameters"].get("required", [])
    expected = ", ".join(f"{p}: {spec.get('type', 'any')}" for p, spec in props.items())
    if isinstance(raw_arguments, dict):
        args: Any = raw_arguments
    else:
        if raw_arguments is None or (isinstance(raw_arguments, str) and not raw_arguments.strip()):
            raw_arguments = "{}"
        try:
            args = json.loads(raw_arguments)
        except (TypeError, ValueError):
            return None, f"error: the arguments of {name} are not valid JSON; expected an object {{{expected}}}"
    if not isinstance(args, dict):
        return None, f"error: the arguments of {name} must be a JSON object {{{expected}}}, got {_type_name(args)}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return None, f"error: {name} has no argument {unknown[0]!r}; expected {{{expected}}}"
    missing = [p for p in required if p not in args]
    if missing:
        return None, f"error: {name} is missing argument {missing[0]!r}; expected {{{expected}}}"
    for p, value in args.items():
        want = props[p].get("type")
        if want is None:
            continue
        ok = isinstance(value, _JSON_TYPES.get(want, (object,)))
        if want in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            return None, f"error: argument {p!r} of {name} must be {want}, got {_type_name(value)} {json.dumps(value)}"
    return args, None


@dataclass
class ToolResult:
    """The outcome of one valid tool call.

    content: the tool message text; finish: the call ends the episode;
    success: the episode's goal is reached (only read when finish); reward: the episode's reward
    when finish (None = ``float(success)``); status: the finishing status (None = completed; e.g.
    ``task error`` when the task could not judge the episode, with ``error`` saying why); metrics:
    numbers added to the finishing reply's metrics.
    """

    content: str
    finish: bool = False
    success: bool = False
    reward: float | None = None
    status: SampleStatus | None = None
    error: str = ""
    metrics: dict[str, float] | None = None


class ToolTaskSession(TaskSession):
    """A session that enforces the shared rules (module docstring) around :meth:`call_tool`."""

    def __init__(self, tools: list[ToolSchema], max_turns: int) -> None:
        """``tools``: the task's function schemas; ``max_turns``: tool calls allowed per episode."""
        self._tools = {t["function"]["name"]: t for t in tools}
        self.max_turns = max_turns
        self.turns = 0
        self.finished = False
        self.closed = False

    @abstractmethod
    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Execute a call to tool ``name`` whose ``arguments`` already match its schema."""

    def extra_metrics(self) -> dict[str, float]:
        """Task-specific metrics added to the finishing reply (none by default)."""
        return {}

    async def interact(self, assistant_message: Message) -> TaskReply:
        """See :meth:`TaskSession.interact`; the rules are in this module's docstring."""
        return self.step(assistant_message)

    async def close(self) -> None:
        """Mark the session closed (built-in tasks hold no external resources)."""
        self.closed = True

    def step(self, assistant_message: Message) -> TaskReply:
        """Synchronous body of :meth:`interact`; raises RuntimeError once the episode is over."""
        if self.finished or self.closed:
            raise RuntimeError("this episode is already over; start a new sample")
        calls = assistant_message.get("tool_calls") or []
        if not calls:
            return self._finish([], SampleStatus.AGENT_INVALID_ACTION, success=False, reward=0.0)
        out: list[Message] = []
        for i, call in enumerate(calls):
            self.turns += 1
            fn = call.get("function") or {}
            name = fn.get("name")
            schema = self._tools.get(name)  # type: ignore[arg-type]
            result: ToolResult | None = None
            if schema is None:
                content = f"error: unknown tool {name!r}; available tools: {', '.join(self._tools)}"
            else:
                args, error = validate_arguments(schema, fn.get("arguments"))
                if error is not None:
                    content = error
                else:
                    result = self.call_tool(name, args)  # type: ignore[arg-type]
                    content = result.content
            out.append({"role": "tool", "tool_call_id": call.get("id") or f"call_{self.turns}", "content": content})
            if result is not None and result.finish:
                reward = float(result.success) if result.reward is None else float(result.reward)
                if i + 1 < len(calls):
                    logger.debug("ignoring %d tool call(s) after the finishing call", len(calls) - i - 1)
                return self._finish(out, result.status or SampleStatus.COMPLETED, success=result.success,
                                    reward=reward, error=result.error, metrics=result.metrics)
            if self.turns >= self.max_turns:
                return self._finish(out, SampleStatus.TASK_LIMIT_REACHED, success=False, reward=0.0)
        return TaskReply(messages=out)

    def _finish(self, messages: list[Message], status: SampleStatus, success: bool, reward: float, error: str = "",
                metrics: dict[str, float] | None = None) -> TaskReply:
        self.finished = True
        metrics = {"success": 1.0 if success else 0.0, "turns": float(self.turns), **self.extra_metrics(),
                   **(metrics or {})}
        return TaskReply(messages=messages, status=status, finish=True, reward=reward, metrics=metrics, error=error)


class ToolTask(Task):
    """A task of small tool-use samples, each a pure function of ``(seed, index)``.

    Subclasses set ``name``, ``TOOLS`` and ``Options`` (a :class:`~env_controller.tasks.options.TaskOptions`
    whose ``KEY`` is the name), implement :meth:`new_session` and :meth:`expert`. ``seed`` selects the sample
    set, ``num_samples`` its size, ``max_turns`` the tool calls allowed per episode.
    """

    #: the task's options class; :func:`~env_controller.tasks.build_task` makes one from plain params
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    #: the task's OpenAI function schemas (the same for every sample); its sessions check calls against them
    TOOLS: ClassVar[list[ToolSchema]]

    def __init__(self, options: TaskOptions | None = None) -> None:
        """``options``: the task's (checked when they were made); None: the defaults."""
        options = options if options is not None else self.Options()
        self.options = options
        self.seed = options.seed
        self.num_samples = options.num_samples
        self.max_turns = options.max_turns

    # -- to implement ------------------------------------------------------------------------

    @abstractmethod
    def new_session(self, index: int) -> tuple[ToolTaskSession, list[Message]]:
        """A fresh session on a valid ``index`` and its first messages (the user prompt)."""

    @abstractmethod
    def expert(self, index: int) -> Expert:
        """The scripted expert on sample ``index`` (see :data:`Expert`)."""

    def careless(self, index: int) -> Expert | None:
        """A low-effort player on sample ``index`` (e.g. one that gives up at once), or None (default)."""
        return None

    # -- shared ------------------------------------------------------------------------------

    def tools(self) -> list[ToolSchema]:
        """The task's OpenAI function schemas, :attr:`TOOLS`."""
        return self.TOOLS

    def indices(self) -> list[int]:
        """``0 .. num_samples - 1``; sample content is fixed by ``(seed, index)``."""
        return list(range(self.num_samples))

    def check_index(self, index: int) -> None:
        """Raise ValueError naming ``index`` when it is not a valid sample index."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_samples:
            raise ValueError(
                f"task {self.name!r} has no sample index {index!r}; valid indices are 0..{self.num_samples - 1}"
            )

    def rng(self, index: int) -> random.Random:
        """The deterministic random generator of sample ``index`` (independent of PYTHONHASHSEED)."""
        return random.Random(f"{self.name}/{self.seed}/{index}")

    async def start(self, index: int) -> tuple[TaskSession, TaskReply]:
        """See :meth:`Task.start`."""
        self.check_index(index)
        session, messages = self.new_session(index)
        return session, TaskReply(messages=messages, tools=self.tools())

    def demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """See :meth:`Task.demonstration`; produced by running :meth:`expert` against a session."""
        self.check_index(index)
        conversation, reply = self._play(index, self.expert(index), "scripted expert")
        if reply.reward < 1.0:
            raise RuntimeError(f"{self.name}: the scripted expert failed on index {index}: {reply}")
        return conversation, self.tools()

    def careless_demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]] | None:
        """See :meth:`Task.careless_demonstration`; runs :meth:`careless`."""
        self.check_index(index)
        player = self.careless(index)
        if player is None:
            return None
        conversation, _ = self._play(index, player, "careless player")
        return conversation, self.tools()

    def _play(self, index: int, player: Expert, who: str) -> tuple[list[Message], TaskReply]:
        """Replay ``player``'s calls through a fresh session until the episode finishes."""
        session, messages = self.new_session(index)
        return self.replay(session, messages, player, index, who)

    def replay(self, session: ToolTaskSession, messages: list[Message], player: Expert, index: int,
               who: str) -> tuple[list[Message], TaskReply]:
        """Send ``player``'s calls through ``session`` (opened on ``index``, whose first ``messages`` start the
        conversation) until the episode finishes: the conversation and the final reply. RuntimeError naming
        ``who`` when it does not finish within ``max_turns``."""
        conversation = list(messages)
        name, args = next(player)
        for turn in range(self.max_turns):
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": [make_tool_call(f"call_{turn}", name, args)],
            }
            reply = session.step(message)
            conversation.append(message)
            conversation.extend(reply.messages)
            if reply.finish:
                return conversation, reply
            name, args = player.send(reply.messages[-1]["content"])
        raise RuntimeError(f"{self.name}: the {who} did not finish index {index} in {self.max_turns} turns")
