"""Helpers shared by the env_controller tests.

A controller with workers on loopback (``cluster``, ``EchoTask``, ``fast_config``) and plain HTTP calls to it;
the ``agentrl`` CLI and a stock ``agentrl-worker`` process; driving a task through the in-process client (an
assistant message with one tool call, an episode replayed from a list of assistant messages, an OS-shell session
taking hostile commands); the commands every sandbox backend must stop; the bwrap processes of this test process."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from env_controller.clients.http_client import HttpEnvClient
from env_controller.clients.local import LocalEnvClient
from env_controller.clients.options import EnvClientOptions
from env_controller.controller.server import Controller, ControllerConfig
from env_controller.http.net import free_port
from env_controller.protocol import SampleStatus, TaskReply
from env_controller.sandbox.bwrap import descendants
from env_controller.tasks import Task, TaskSession
from env_controller.tasks.base import make_tool_call
from env_controller.worker.options import WorkerOptions
from env_controller.worker.server import WorkerServer

# ------------------------------------------------------------------------------- the controller on loopback
LIMIT_S = 60.0


def run(coro: Awaitable[Any], limit: float = LIMIT_S) -> Any:
    """Run a coroutine with an overall time limit."""
    return asyncio.run(asyncio.wait_for(coro, limit))


def tool_call(name: str, args: dict[str, Any], call_id: str = "c0") -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [make_tool_call(call_id, name, args)]}


class EchoSession(TaskSession):
    """Tools: ``echo(text)``, ``sleep(seconds)`` (then echoes), ``finish()`` (reward 1)."""

    def __init__(self, task: "EchoTask") -> None:
        self.task = task
        self.closed = False

    async def interact(self, assistant_message: dict[str, Any]) -> TaskReply:
        call = assistant_message["tool_calls"][0]
        name = call["function"]["name"]
        args = json.loads(call["function"]["arguments"])
        if name == "sleep":
            await asyncio.sleep(args["seconds"])
            name = "echo"
        if name == "finish":
            return TaskReply(
                messages=[], status=SampleStatus.COMPLETED, finish=True, reward=1.0, metrics={"success": 1.0}
            )
        if name == "boom":
            raise RuntimeError("the sandbox exploded")
        return TaskReply(
            messages=[{"role": "tool", "tool_call_id": call["id"], "content": str(args.get("text", "slept"))}]
        )

    async def close(self) -> None:
        self.closed = True
        self.task.closed += 1


class EchoTask(Task):
    """A tiny task for protocol tests (10 samples)."""

    name = "echo"

    def __init__(self) -> None:
        self.closed = 0

    def indices(self) -> list[int]:
        return list(range(10))

    async def start(self, index: int) -> tuple[TaskSession, TaskReply]:
        if index == 9:
            raise RuntimeError("sample 9 is broken")
        return EchoSession(self), TaskReply(messages=[{"role": "user", "content": f"sample {index}"}], tools=[])

    def demonstration(self, index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        raise NotImplementedError


def fast_config(**kw: Any) -> ControllerConfig:
    base: dict[str, Any] = dict(port=0, suspect_after_s=2.0, heartbeat_timeout_s=4.0)
    base.update(kw)
    return ControllerConfig(**base)


@contextlib.asynccontextmanager
async def cluster(
    tasks: list[Task] | None = None,
    config: ControllerConfig | None = None,
    heartbeat_s: float = 0.2,
    **worker_kw: Any,
) -> AsyncIterator[tuple[Controller, list[WorkerServer], HttpEnvClient]]:
    """A controller, one worker per task (registered before yielding) and a client."""
    controller = Controller(config or fast_config())
    workers: list[WorkerServer] = []
    client: HttpEnvClient | None = None
    await controller.start()
    try:
        for task in tasks if tasks is not None else [EchoTask()]:
            w = WorkerServer(task, WorkerOptions(controller_url=controller.url, heartbeat_interval_s=heartbeat_s,
                                                 **worker_kw))
            workers.append(w)
            await w.start()
            assert w.heartbeat_ok is not None
            await asyncio.wait_for(w.heartbeat_ok.wait(), 10)
        client = HttpEnvClient(controller.url, EnvClientOptions(retries=0, timeout_s=30))
        yield controller, workers, client
    finally:
        if client is not None:
            await client.aclose()
        for w in workers:
            await w.stop()
        await controller.stop()


async def raw(
    url: str, method: str = "POST", data: Any = None, headers: dict[str, str] | None = None, json_body: Any = None
) -> tuple[int, Any, Any]:
    """One plain HTTP call; returns (status, parsed JSON or text, headers)."""
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, data=data, json=json_body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=20)) as r:
            text = await r.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = text
            return r.status, body, r.headers


async def beat(controller_url: str, worker: WorkerServer, **override: Any) -> tuple[int, Any]:
    """Send one heartbeat on behalf of ``worker`` (tests that drive heartbeats by hand)."""
    body = {
        "name": worker.name,
        "address": worker.address,
        "concurrency": worker.concurrency,
        "indices": worker.indices,
    }
    body.update(override)
    status, payload, _ = await raw(controller_url + "/receive_heartbeat", json_body=body)
    return status, payload


# ---------------------------------------------------------------------------------------------- processes
AGENTRL = [sys.executable, "-m", "megatron_agentrl.cli"]

TASK_MODULE = '''
"""An AgentRL task: add two numbers (tool ``add``), then ``answer``."""
import json

from agentrl.worker.task import Session, Task
from agentrl.worker.typings import RewardHistoryItem, SampleStatus, TaskSampleExecutionResult

TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add a and b.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "answer", "description": "The final answer.", "parameters": {
        "type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"]}}},
]


class AddTask(Task):
    def __init__(self, num_samples=20, **kwargs):
        super().__init__(tools=TOOLS, full_async=True, **kwargs)
        self.num_samples = num_samples

    def get_indices(self):
        return list(range(self.num_samples))

    async def start_sample(self, index, session: Session):
        a, b = index, 2 * index + 1
        session.inject({"role": "user", "content": f"What is {a} + {b}?"})
        for _ in range(4):
            out = await session.action()
            calls = out.messages[-1].get("tool_calls") or []
            if not calls:
                session.inject(RewardHistoryItem(reward=0.0, metrics={"success": 0.0}))
                return TaskSampleExecutionResult(status=SampleStatus.AGENT_INVALID_ACTION)
            call = calls[0]
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "add":
                session.inject({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
                continue
            ok = args.get("value") == a + b
            session.inject({"role": "tool", "tool_call_id": call["id"], "content": "correct" if ok else "wrong"})
            session.inject(RewardHistoryItem(reward=float(ok), metrics={"success": float(ok)}))
            return TaskSampleExecutionResult(status=SampleStatus.COMPLETED, result={"ok": ok})
        session.inject(RewardHistoryItem(reward=0.0, metrics={"success": 0.0}))
        return TaskSampleExecutionResult(status=SampleStatus.TASK_LIMIT_REACHED)
'''

CONFIG = """
arwadd:
  module: arw_add_task.AddTask
  parameters:
    name: arwadd
    concurrency: 4
    num_samples: 20
"""


def start_agentrl_worker(
    files: Path, controller_url: str, processes: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    address = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PYTHONPATH=str(files) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.worker", "arwadd", "--config", str(files / "arw.yaml"),
         "--controller", controller_url, "--self", address, "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    processes.append(proc)
    return proc, address


async def wait_registered(
    env: HttpEnvClient, proc: subprocess.Popen[bytes], name: str, limit_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            raise AssertionError(f"agentrl worker exited with {proc.returncode}: {stderr}")
        workers = await env.list_workers()
        if name in workers and all([await _listens(w["address"]) for w in workers[name]["workers"].values()]):
            return workers[name]
        await asyncio.sleep(0.1)
    raise AssertionError(f"the agentrl worker did not register and listen within {limit_s} s")


async def _listens(address: str) -> bool:
    """Whether the worker at ``address`` accepts connections: a stock AgentRL worker sends its first heartbeat
    before its server listens, and a start the controller sends it then marks it suspect until its next beat."""
    url = urllib.parse.urlsplit(address)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port), 2.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


# ---------------------------------------------------------------------------------------- tasks in process
def run_coro(coro: Any) -> Any:
    """``asyncio.run`` without an overall time limit (the os_shell tests: each command has its own)."""
    return asyncio.run(coro)


def call(name: str, args: Any, call_id: str = "c0") -> dict[str, Any]:
    """An assistant message with one tool call; ``args`` dict (JSON-encoded) or a raw string."""
    message = make_tool_call(call_id, name, {})
    message["function"]["arguments"] = args if isinstance(args, str) else json.dumps(args)
    return {"role": "assistant", "content": "", "tool_calls": [message]}


async def replay(c: LocalEnvClient, name: str, index: int,
                 assistant: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], TaskReply]:
    """Start sample ``index`` of task ``name`` and send the assistant messages in order; return the
    whole conversation and the last reply."""
    sid, reply = await c.start_sample(name, index)
    conversation = list(reply.messages)
    for message in assistant:
        assert not reply.finish
        conversation.append(message)
        reply = await c.interact(sid, [message])
        conversation.extend(reply.messages)
    return conversation, reply


async def attempts_then_solve(c: LocalEnvClient, index: int, attempts: list[tuple[str, list[str]]]) -> TaskReply:
    """On os_shell sample ``index`` (a question), run each ``(script, expected)`` of ``attempts`` as a
    ``bash_action``: the reply must hold every expected text and leave the episode running. Then solve
    the sample with its solution: the answer must be right (the sandbox survived). Returns the last reply."""
    task = c.tasks["os_shell"]
    sid, _ = await c.start_sample("os_shell", index)
    for script, expected in attempts:
        reply = await c.interact(sid, [call("bash_action", {"script": script})])
        content = reply.messages[0]["content"]
        assert all(e in content for e in expected), (script, content)
        if not any("memory" in e.lower() for e in expected):  # a process the memory limit killed is reported
            assert "Killed" not in content, (script, content)  # but no job notice of bash's own
        assert reply.status.value == "running" and not reply.finish, (script, reply)
        assert len(content) < 4500, script  # max_output_chars=4000 plus the messages
    reply = await c.interact(sid, [call("bash_action", {"script": task.sample(index).solution})])
    reply = await c.interact(sid, [call("answer_action", {"answer": reply.messages[0]["content"]})])
    assert reply.finish and reply.reward == 1.0, reply
    assert reply.metrics["commands"] == len(attempts) + 1
    return reply


# -------------------------------------------------------------------------------------------- sandboxes
#: never end on their own: each must end at the time limit with nothing left running
NEVER_ENDING = ("sleep 1000", "while :; do :; done", "trap '' TERM INT HUP; sleep 1000",
                "setsid sleep 1000 & disown; sleep 1000", "(sleep 1000 &); sleep 1000")
#: print without end, also from stderr and from a process the command does not wait for
FLOODS = ("yes", "cat /dev/urandom", "yes > /dev/stderr", "(yes &); sleep 5")


def loopback_listener() -> tuple[socket.socket, int]:
    """A TCP listener on the host's loopback (accept times out after 0.2 s) that no sandbox may reach, and its port;
    the caller closes it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    return listener, listener.getsockname()[1]


def run_never_ending(box: Any) -> Iterator[tuple[str, Any, float]]:
    """Each of ``NEVER_ENDING`` in ``box`` under a 1 s limit, killed at the limit and the shell restarted: yields the
    script, its result and the seconds it took."""
    for script in NEVER_ENDING:
        started = time.monotonic()
        r = box.run(script, timeout_s=1)
        elapsed = time.monotonic() - started
        assert r.limit == "timeout" and r.exit_code is None and r.restarted, (script, r)
        yield script, r, elapsed


def run_floods(box: Any) -> list[Any]:
    """Each of ``FLOODS`` in ``box`` (8192 bytes of output at most): cut at the limit within 4 s, the sandbox fine
    after it; returns their results."""
    results = []
    for script in FLOODS:
        started = time.monotonic()
        r = box.run(script)
        assert r.limit == "output_limit" and r.truncated and time.monotonic() - started < 4, (script, r)
        assert "8192 bytes" in r.error and box.run("echo fine").output == "fine\n"
        results.append(r)
    return results


def run_foreground_bomb(box: Any) -> tuple[Any, float]:
    """In ``box`` (32 processes at most), after ``cd /tmp; export KEEP=1``: a fork bomb in the foreground, stopped at
    the limit with the shell restarted; returns its result and when it started (``time.monotonic()``)."""
    box.run("cd /tmp; export KEEP=1")
    started = time.monotonic()
    r = box.run("f() { f | f; }; f")
    assert r.limit == "process_limit" and r.restarted, r
    return r, started


def run_background_bomb(box: Any) -> None:
    """In ``box`` (background jobs allowed, 32 processes at most): a fork bomb that returns at once and multiplies in
    the background, stopped at the limit at once or, on a starved CPU, by the next command."""
    r = box.run("bomb() { bomb | bomb & }; bomb")
    if r.limit is None:  # on a starved CPU it may reach the limit only after the check
        time.sleep(1)
        r = box.run("true")
        assert r.limit == "process_limit" or r.output.startswith(
            "[note: background processes had reached the limit of 32 processes and were killed"), r
    else:
        assert r.limit == "process_limit" and r.restarted, r


def _identity(pid: int) -> tuple[int, bytes] | None:
    """``(pid, start time)`` of a live, non-zombie process (pids get reused), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return None if fields[0] == b"Z" else (pid, fields[19])


def _our_bwraps() -> list[int]:
    out = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"bwrap" in f.read().split(b"\0")[0]:
                    out.append(pid)
        except OSError:
            pass
    return out


def wait_for_oom_kills(cgroup: Any, at_least: int, settle_s: float = 1.0, timeout_s: float = 30.0) -> int:
    """Wait until the sandbox cgroup's OOM-kill count reaches ``at_least`` and then stays the same for
    ``settle_s`` (background hogs on a loaded machine are killed one after another, seconds apart: a kill
    that lands during the next command would be that command's); returns the count."""
    deadline = time.monotonic() + timeout_s
    count, since = cgroup.oom_kills() or 0, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = cgroup.oom_kills() or 0
        if now != count:
            count, since = now, time.monotonic()
        elif count >= at_least and time.monotonic() - since >= settle_s:
            break
    return count
