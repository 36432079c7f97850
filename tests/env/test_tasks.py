"""Built-in tool-use tasks (lookup, calc, guess) and the in-process LocalEnvClient."""
from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from env_controller.clients.local import LocalEnvClient, MalformedMessageError, UnknownSessionError
from env_controller.options import FieldError
from env_controller.protocol import SampleStatus, TaskReply
from env_controller.tasks import TASKS, Task, TaskSession, build_task
from env_controller.tasks.base import make_tool_call
from tests.env.support import call, replay

NAMES = ["lookup", "calc", "guess"]
REPO = Path(__file__).resolve().parents[2]


def run(coro: Any) -> Any:
    """Run a coroutine to completion (no pytest-asyncio needed)."""
    return asyncio.run(coro)


def client(name: str, **params: Any) -> LocalEnvClient:
    return LocalEnvClient({name: build_task(name, **params)})


# ----------------------------------------------------------------------------------------------
# demonstrations, rewards, rules


@pytest.mark.parametrize("name", NAMES)
def test_demonstration_replays_to_full_reward(name: str) -> None:
    task = build_task(name)
    c = LocalEnvClient({name: task})

    async def go() -> None:
        for index in task.indices()[:200]:
            demo, tools = task.demonstration(index)
            assert demo[0]["role"] == "user" and demo[-1]["role"] == "tool"
            assistant = [m for m in demo if m["role"] == "assistant"]
            assert len(assistant) == 2 if name != "guess" else 1 <= len(assistant) <= task.max_turns
            sid, first = await c.start_sample(name, index)
            assert first.tools == tools and first.status is SampleStatus.RUNNING and not first.finish
            await c.cancel(sid)
            conversation, reply = await replay(c, name, index, assistant)
            assert conversation == demo
            assert reply.finish and reply.status is SampleStatus.COMPLETED
            assert reply.reward == 1.0 and reply.metrics["success"] == 1.0
            json.dumps(reply.to_json())
        assert c.list_sessions() == []

    run(go())


@pytest.mark.parametrize("name, most", [("lookup", 0.0), ("calc", 0.0), ("guess", 0.15)])
def test_careless_demonstrations_replay_and_mostly_fail(name: str, most: float) -> None:
    """The careless player's conversations are real episodes (replayable), fixed per index, and
    succeed far less often than the expert: what the demo's warm-up mixes in for RL to unlearn."""
    task = build_task(name)
    c = LocalEnvClient({name: task})

    async def go() -> float:
        wins = 0
        for index in task.indices()[:120]:
            demo, tools = task.careless_demonstration(index)
            assert tools == task.tools() and demo == task.careless_demonstration(index)[0]
            assistant = [m for m in demo if m["role"] == "assistant"]
            conversation, reply = await replay(c, name, index, assistant)
            assert conversation == demo and reply.finish
            wins += reply.metrics["success"] == 1.0
        return wins / 120

    assert run(go()) <= most
    if name != "guess":   # the careless lookup/calc player never calls the tool
        assert all(m["tool_calls"][0]["function"]["name"] == "answer"
                   for i in range(20) for m in task.careless_demonstration(i)[0] if m["role"] == "assistant")


def test_wrong_answers_get_zero() -> None:
    async def go() -> None:
        lookup = build_task("lookup")
        table, key = lookup.sample(0)
        wrong = next(v for v in ("red", "blue") if v != table[key])
        _, reply = await replay(client("lookup"), "lookup", 0,
                                [call("lookup", {"key": key}), call("answer", {"value": wrong})])
        assert reply.finish and reply.status is SampleStatus.COMPLETED
        assert reply.reward == 0.0 and reply.metrics["success"] == 0.0
        # case and a trailing period do not matter
        _, reply = await replay(client("lookup"), "lookup", 0, [call("answer", {"value": f" {table[key].upper()}."})])
        assert reply.reward == 1.0

        calc = build_task("calc")
        demo, _ = calc.demonstration(5)
        result = int(demo[2]["content"])
        _, reply = await replay(client("calc"), "calc", 5, [call("answer", {"value": result + 1})])
        assert reply.finish and reply.reward == 0.0 and reply.metrics["success"] == 0.0
        _, reply = await replay(client("calc"), "calc", 5, [call("answer", {"value": result})])
        assert reply.reward == 1.0  # tool use is not required, only the exact result

        guess = build_task("guess")
        target = guess.target(7)
        wrong = [n for n in range(1, 16) if n != target][:4]
        conversation, reply = await replay(client("guess"), "guess", 7, [call("guess", {"n": n}) for n in wrong])
        feedback = [m["content"] for m in conversation if m["role"] == "tool"]
        assert feedback == ["higher" if target > n else "lower" for n in wrong]
        assert reply.finish and reply.status is SampleStatus.TASK_LIMIT_REACHED
        assert reply.reward == 0.0 and reply.metrics["success"] == 0.0

    run(go())


BAD_CALLS = {
    "lookup": [("lookup", {"name": "x"}, "no argument 'name'"),
               ("lookup", {"key": 3}, "must be string"),
               ("answer", {}, "missing argument 'value'")],
    "calc": [("add", {"a": 1}, "missing argument 'b'"),
             ("multiply", {"a": "2", "b": 3}, "'a' of multiply must be integer"),
             ("answer", {"value": True}, "must be integer")],
    "guess": [("guess", {"n": 2.5}, "must be integer"),
              ("guess", {"n": 99}, "from 1 to 15"),
              ("guess", {"x": 1}, "no argument 'x'")],
}


@pytest.mark.parametrize("name", NAMES)
def test_bad_calls_get_explanations_and_cost_a_turn(name: str) -> None:
    async def go() -> None:
        c = client(name, max_turns=6)
        sid, _ = await c.start_sample(name, 0)
        messages = [call(tool, args, f"c{i}") for i, (tool, args, _) in enumerate(BAD_CALLS[name])]
        messages += [call("launch", {"x": 1}, "u"), call(BAD_CALLS[name][0][0], "{not json", "j")]
        expected = [text for _, _, text in BAD_CALLS[name]] + ["unknown tool 'launch'", "not valid JSON"]
        for message, text in zip(messages, expected):
            reply = await c.interact(sid, [message])
            assert len(reply.messages) == 1
            tool_message = reply.messages[0]
            assert tool_message["role"] == "tool"
            assert tool_message["tool_call_id"] == message["tool_calls"][0]["id"]
            assert tool_message["content"].startswith("error:") and text in tool_message["content"], tool_message
            assert not reply.finish and reply.status is SampleStatus.RUNNING and reply.metrics == {}
        # the agent recovers: the rest of the turn budget (one call) is still usable
        assert len(messages) == len(expected) == 5 and c.list_sessions() == [sid]
        demo, _ = c.tasks[name].demonstration(0)
        last_call = [m for m in demo if m["role"] == "assistant"][-1]
        if name != "guess":  # the final call alone wins in lookup/calc
            reply = await c.interact(sid, [last_call])
            assert reply.finish and reply.reward == 1.0 and reply.metrics["turns"] == 6.0

    run(go())


@pytest.mark.parametrize("name", NAMES)
def test_turn_limit(name: str) -> None:
    async def go() -> None:
        task = build_task(name)
        c = LocalEnvClient({name: task})
        sid, _ = await c.start_sample(name, 1)
        for turn in range(1, task.max_turns + 1):
            reply = await c.interact(sid, [call("nonexistent", {})])
            assert reply.finish == (turn == task.max_turns)
        assert reply.status is SampleStatus.TASK_LIMIT_REACHED
        assert reply.reward == 0.0 and reply.metrics == {"success": 0.0, "turns": float(task.max_turns)}
        assert c.list_sessions() == []
        with pytest.raises(UnknownSessionError, match="finished"):
            await c.interact(sid, [call("nonexistent", {})])

    run(go())


@pytest.mark.parametrize("name", NAMES)
def test_message_without_tool_calls_is_an_invalid_action(name: str) -> None:
    async def go() -> None:
        c = client(name)
        for body in ({"role": "assistant", "content": "the answer is 4"},
                     {"role": "assistant", "content": None, "tool_calls": []}):
            sid, _ = await c.start_sample(name, 2)
            reply = await c.interact(sid, [body])
            assert reply.finish and reply.status is SampleStatus.AGENT_INVALID_ACTION
            assert reply.reward == 0.0 and reply.metrics["success"] == 0.0 and reply.messages == []
        assert c.list_sessions() == []

    run(go())


def test_several_calls_in_one_message() -> None:
    async def go() -> None:
        task = build_task("lookup")
        table, key = task.sample(3)
        body = {"role": "assistant", "content": "", "tool_calls": [
            make_tool_call("a", "lookup", {"key": key}),
            make_tool_call("b", "answer", {"value": table[key]}),
            make_tool_call("c", "answer", {"value": "nothing"}),
        ]}
        c = LocalEnvClient({"lookup": task})
        sid, _ = await c.start_sample("lookup", 3)
        reply = await c.interact(sid, [body])
        assert [m["tool_call_id"] for m in reply.messages] == ["a", "b"]  # calls after the finish are ignored
        assert reply.reward == 1.0 and reply.metrics["turns"] == 2.0

        guess = build_task("guess")
        c = LocalEnvClient({"guess": guess})
        sid, _ = await c.start_sample("guess", 0)
        wrong = [n for n in range(1, 16) if n != guess.target(0)][:5]
        body = {"role": "assistant", "content": "",
                "tool_calls": [make_tool_call(f"g{n}", "guess", {"n": n}) for n in wrong]}
        reply = await c.interact(sid, [body])  # each call is a turn: the limit stops the 5th
        assert len(reply.messages) == 4 and reply.status is SampleStatus.TASK_LIMIT_REACHED

    run(go())


# ----------------------------------------------------------------------------------------------
# determinism, registry, params


@pytest.mark.parametrize("name", NAMES)
def test_indices_and_samples_are_deterministic(name: str) -> None:
    a, b, other = build_task(name, seed=3), build_task(name, seed=3), build_task(name, seed=4)
    assert a.indices() == b.indices() == list(range(512))
    assert build_task(name, num_samples=40).indices() == list(range(40))
    demos_a = [a.demonstration(i)[0] for i in range(30)]
    assert demos_a == [b.demonstration(i)[0] for i in range(30)]
    assert demos_a != [other.demonstration(i)[0] for i in range(30)]
    prompts = {d[0]["content"] for d in demos_a}
    assert len(prompts) > 1 or name == "guess"
    # the same as in a fresh interpreter with another hash seed
    code = f"from env_controller.tasks import build_task; print(build_task({name!r}, seed=3).demonstration(11)[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == str(demos_a[11])


def test_registry_and_param_errors() -> None:
    # the sandbox, database and terminal tasks have their own tests
    assert set(TASKS) == set(NAMES) | {"os_shell", "db", "terminal"}
    assert all(issubclass(cls, Task) for cls in TASKS.values())
    with pytest.raises(ValueError,
                       match=r"unknown task 'sudoku'; registered tasks: calc, db, guess, lookup, os_shell, terminal"):
        build_task("sudoku")
    with pytest.raises(ValueError, match=r"unknown config key 'calc.nkeys' "
                                         r"\(valid keys here: seed, num_samples, max_turns, low, high\)"):
        build_task("calc", nkeys=3)
    with pytest.raises(ValueError, match=r"num_samples=0"):
        build_task("lookup", num_samples=0)
    with pytest.raises(ValueError, match=r"num_keys=99"):
        build_task("lookup", num_keys=99)
    with pytest.raises(ValueError, match=r"calc.high=3 must be above low=9"):
        build_task("calc", low=9, high=3)
    with pytest.raises(ValueError, match=r"max_turns=2 is too few"):
        build_task("guess", max_turns=2)
    easy = build_task("guess", max_value=7, max_turns=3)
    assert max(sum(m["role"] == "assistant" for m in easy.demonstration(i)[0]) for i in range(50)) == 3


@pytest.mark.parametrize("name, params, param, rule", [
    ("calc", {"nkeys": 3}, "nkeys",
     "is not a key here (valid keys here: seed, num_samples, max_turns, low, high)"),
    ("lookup", {"seed": 1.5}, "seed", "must be an integer"),
    ("lookup", {"num_samples": True}, "num_samples", "must be an integer"),
    ("lookup", {"num_keys": 99}, "num_keys", "must be an integer in 1..24"),
    ("calc", {"low": -1}, "low", "must be an integer >= 0"),
    ("calc", {"low": 9, "high": 3}, "high", "must be above low=9"),
    ("guess", {"max_value": 1}, "max_value", "must be an integer >= 2"),
    ("guess", {"max_turns": 2}, "max_turns", "is too few to always find a number in 1..15 (bisection needs 4); "
                                             "raise max_turns or lower max_value"),
    ("os_shell", {"command_timeout_s": float("inf")}, "command_timeout_s", "must be a finite number"),
    ("os_shell", {"max_processes": 3}, "max_processes", "must be an integer >= 4 (the sandbox's shell alone needs 3)"),
    ("os_shell", {"memory_mb": 0}, "memory_mb",
     "must be an integer >= 16 (a sandbox's shell needs more, and Docker refuses less than 6 MB)"),
    ("os_shell", {"image": ""}, "image", "must be a non-empty string"),
    ("os_shell", {"max_workers": 0}, "max_workers", "must be a positive integer"),
    ("db", {"port": 70000}, "port", "must be an integer in 1..65535"),
    ("db", {"admin_password": 1234}, "admin_password", "must be a string"),
    ("db", {"unix_socket": 5}, "unix_socket", "must be a string"),
    ("db", {"start_server": "yes"}, "start_server", "must be true or false"),
    ("db", {"query_timeout_s": float("nan")}, "query_timeout_s", "must be a finite number"),
    ("db", {"max_output_chars": 10}, "max_output_chars", "must be an integer >= 100"),
])
def test_each_task_names_its_bad_param(name: str, params: dict[str, Any], param: str, rule: str) -> None:
    """Every built-in task checks its own params when built; the error names the param, the value and the rule,
    which the trainer's config turns into ``tasks[i].params.<param>=<value> <rule>``."""
    with pytest.raises(FieldError) as info:
        build_task(name, **params)
    assert (info.value.name, info.value.value, info.value.rule) == (param, params[param], rule)
    assert isinstance(info.value, ValueError) and str(info.value)


# ----------------------------------------------------------------------------------------------
# LocalEnvClient


def test_client_errors_and_session_lifecycle() -> None:
    async def go() -> None:
        c = LocalEnvClient({name: build_task(name, num_samples=10) for name in NAMES})
        with pytest.raises(ValueError, match=r"unknown task 'nope'; this client serves: calc, guess, lookup"):
            await c.start_sample("nope", 0)
        with pytest.raises(ValueError, match=r"task 'calc' has no sample index 10"):
            await c.start_sample("calc", 10)
        with pytest.raises(UnknownSessionError, match="unknown session 'zzz'"):
            await c.interact("zzz", [call("add", {"a": 1, "b": 2})])
        assert isinstance(UnknownSessionError("x"), KeyError)

        s1, r1 = await c.start_sample("calc", 0)
        s2, _ = await c.start_sample("calc", 0)
        assert s1 != s2 and c.list_sessions() == [s1, s2]
        assert r1.messages[0]["role"] == "user"
        assert [t["function"]["name"] for t in r1.tools] == ["add", "multiply", "answer"]

        malformed: list[tuple[Any, str]] = [
            ({"role": "assistant"}, "must be a list"),
            ([], "exactly one assistant message, got a list of 0"),
            ([{"role": "user", "content": "hi"}], "role must be 'assistant'"),
            ([{"role": "assistant", "content": 5}], "content must be a string or null"),
            ([{"role": "assistant", "tool_calls": {"name": "add"}}], "tool_calls must be a list"),
            ([{"role": "assistant", "tool_calls": ["add"]}], r"tool_calls\[0\] must be an object"),
            ([{"role": "assistant", "tool_calls": [{"id": "a", "name": "add"}]}],
             r"tool_calls\[0\].function must be an object"),
            ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
             r"function.name must be a non-empty string"),
            ([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": 5}}]}],
             r"arguments must be a JSON string"),
            ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "add"}}]}],
             r"type must be 'function'"),
            ([{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "add"}}]}],
             r"id must be a non-empty string"),
        ]
        for body, text in malformed:
            with pytest.raises(MalformedMessageError, match=text):
                await c.interact(s1, body)
        assert c.list_sessions() == [s1, s2]  # a malformed body leaves the session as it was

        # arguments as a dict and a missing id are accepted
        reply = await c.interact(
            s1, [{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}])
        assert reply.messages == [{"role": "tool", "tool_call_id": "call_0", "content": "5"}]

        await c.cancel(s1)
        await c.cancel(s1)
        await c.cancel("never-existed")
        assert c.list_sessions() == [s2]
        with pytest.raises(UnknownSessionError):
            await c.interact(s1, [call("add", {"a": 1, "b": 2})])
        await c.aclose()
        assert c.list_sessions() == []
        assert c.indices("guess") == list(range(10))

    run(go())


class _SlowSession(TaskSession):
    """A session whose interact hangs or raises."""

    def __init__(self, mode: str) -> None:
        self.mode, self.closed = mode, False

    async def interact(self, assistant_message: dict[str, Any]) -> TaskReply:
        if self.mode == "hang":
            await asyncio.sleep(10)
        raise RuntimeError("the task broke")

    async def close(self) -> None:
        self.closed = True


class _BrokenTask(Task):
    name = "broken"

    def __init__(self) -> None:
        self.sessions: list[_SlowSession] = []

    def indices(self) -> list[int]:
        return [0, 1]

    async def start(self, index: int) -> tuple[TaskSession, TaskReply]:
        session = _SlowSession("hang" if index == 0 else "raise")
        self.sessions.append(session)
        return session, TaskReply(messages=[{"role": "user", "content": "hi"}])

    def demonstration(self, index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return [], []


def test_task_timeout_and_failure_end_in_task_error() -> None:
    async def go() -> None:
        task = _BrokenTask()
        c = LocalEnvClient({"broken": task}, timeout_s=0.2)
        for index in (0, 1):
            sid, _ = await c.start_sample("broken", index)
            reply = await c.interact(sid, [call("x", {})])
            assert reply.finish and reply.status is SampleStatus.TASK_ERROR and reply.reward == 0.0
            assert sid not in c.list_sessions() and task.sessions[index].closed

    run(go())


def test_env_controller_does_not_import_torch() -> None:
    code = ("import sys, env_controller.clients.local, env_controller.tasks; "
            "assert 'torch' not in sys.modules, 'env_controller imported torch'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={"PYTHONPATH": str(REPO)})


# ----------------------------------------------------------------------------------------------
# a random policy: some signal, not too much, and the tasks differ


def random_message(rng: random.Random, tools: list[dict[str, Any]], conversation: list[dict[str, Any]],
                   turn: int) -> dict[str, Any]:
    """A uniformly random tool with arguments copied from the observations.

    Each argument draws from the latest user/tool message (probability 1/2) or from all of them:
    a string is a random word of that text; an integer is one of its numbers (3/4) or uniform
    between the smallest and largest number seen.
    """
    fn = rng.choice(tools)["function"]
    observations = [m["content"] for m in conversation if m["role"] in ("user", "tool")]
    everything = " ".join(observations)
    args: dict[str, Any] = {}
    for param, spec in fn["parameters"]["properties"].items():
        text = observations[-1] if rng.random() < 0.5 else everything
        if spec["type"] == "integer":
            seen = [int(x) for x in re.findall(r"\d+", everything)]
            near = [int(x) for x in re.findall(r"\d+", text)] or seen
            args[param] = rng.choice(near) if rng.random() < 0.75 else rng.randint(min(seen), max(seen))
        else:
            args[param] = rng.choice(re.findall(r"[a-z]+", text.lower()) or ["x"])
    return {"role": "assistant", "content": "", "tool_calls": [make_tool_call(f"call_{turn}", fn["name"], args)]}


def random_policy_success(name: str, episodes: int, seed: int) -> float:
    """Success rate of :func:`random_message` on ``episodes`` samples of task ``name``."""

    async def go() -> float:
        c = client(name)
        rng = random.Random(seed)
        wins = 0.0
        for episode in range(episodes):
            sid, reply = await c.start_sample(name, episode % 512)
            tools, conversation, turn = reply.tools, list(reply.messages), 0
            while not reply.finish:
                message = random_message(rng, tools, conversation, turn)
                turn += 1
                reply = await c.interact(sid, [message])
                conversation += [message, *reply.messages]
            wins += reply.metrics["success"]
        return wins / episodes

    return run(go())


def test_random_policy_succeeds_sometimes_and_tasks_differ() -> None:
    rates = {name: random_policy_success(name, episodes=1500, seed=0) for name in NAMES}
    for name, rate in rates.items():
        assert 0.01 <= rate <= 0.6, (name, rate)
    assert max(rates.values()) - min(rates.values()) >= 0.05, rates
