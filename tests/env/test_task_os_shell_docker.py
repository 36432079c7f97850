"""The ``os_shell`` task on a real Docker engine (a private dockerd started by the tests): one container per
session, as in AgentBench, removed when the session ends or is cancelled. Skips only where dockerd cannot run."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from env_controller.clients.local import LocalEnvClient
from env_controller.options import FieldError
from env_controller.protocol import SampleStatus
from env_controller.sandbox import SandboxUnavailableError
from env_controller.sandbox.docker import LABEL, DockerBackend
from env_controller.tasks import build_task
from env_controller.tasks.os_shell import OsShellTask
from tests.env.support import attempts_then_solve, call, replay
from tests.env.support import run_coro as run

pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")


def _containers(engine: Any, **labels: str) -> list[dict[str, Any]]:
    """The engine's sandbox containers carrying ``labels`` (``agentrl.task``, ``agentrl.index``...), as the rows of
    one list call (docker-py's ``containers.list`` inspects each one after listing: a container removed meanwhile
    fails it)."""
    wanted = [f"{LABEL}=1"] + [f"agentrl.{k}={v}" for k, v in labels.items()]
    client = engine.client()
    try:
        return client.api.containers(all=True, filters={"label": wanted})
    finally:
        client.close()


@pytest.fixture
def task(docker_engine: Any, os_shell_image: str) -> Iterator[OsShellTask]:
    t = build_task("os_shell", backend="docker", image=os_shell_image, docker_host=docker_engine.url,
                   command_timeout_s=3, max_processes=32, memory_mb=128, max_turns=12)
    assert isinstance(t, OsShellTask)
    try:
        yield t
    finally:
        t.close()
        assert _containers(docker_engine, task="os_shell") == [], "a container outlived the task"


def test_samples_solved_on_docker(task: OsShellTask, docker_engine: Any, os_shell_image: str) -> None:
    async def go() -> None:
        c = LocalEnvClient({"os_shell": task})
        for index in (0, 3, 4, 7, 9, 11):  # three questions, three changes
            sample = task.sample(index)
            finish = (call("answer_action", {"answer": sample.answer}) if sample.answer is not None
                      else call("finish_action", {}))
            _, reply = await replay(c, "os_shell", index, [call("bash_action", {"script": sample.solution}), finish])
            assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 1.0, (index, reply)
            assert reply.metrics == {"success": 1.0, "turns": 2.0, "commands": 1.0, "limit_hits": 0.0}
            assert _containers(docker_engine, task="os_shell") == []  # the session's end removed it
        backend = task.backend
        assert isinstance(backend, DockerBackend) and backend.image == os_shell_image
        assert backend.health()["counting"] == "host" and backend.live() == []

    run(go())
    demo, _ = task.demonstration(5)  # the scripted expert, for the SFT warm-up
    assert demo[-1]["content"] == "correct"


def test_limits_and_escapes_get_clear_tool_errors(task: OsShellTask) -> None:
    attempts = [
        ("sleep 100 & echo started", ["started\n[note: 1 process left running in the background stopped"]),
        ("exec 3<>/dev/tcp/1.1.1.1/80", ["Network is unreachable", "[exit code 1]"]),
        ("echo pwned > /etc/motd", ["Read-only file system", "[exit code 1]"]),
        ("bomb() { bomb | bomb; }; bomb", ["error: the command reached the limit of 32 processes (a fork bomb?)"]),
        ("sleep 600", ["error: the command ran past the 3 s time limit and was killed"]),
        ("yes 'flood'", ["error: the command printed more than", "output before it was stopped:\nflood\nflood"]),
        ("head -c 200M /dev/zero | tail -c 200M > /dev/null; echo after",
         ["error: the command was killed because the sandbox's memory limit of 128 MB was reached"]),
    ]

    async def go() -> None:
        reply = await attempts_then_solve(LocalEnvClient({"os_shell": task}), 3, attempts)  # 3: a question
        assert reply.metrics["limit_hits"] == 4.0

    run(go())


def test_one_container_per_session_removed_on_cancel(task: OsShellTask, docker_engine: Any) -> None:
    async def go() -> None:
        c = LocalEnvClient({"os_shell": task})
        started = await asyncio.gather(*(c.start_sample("os_shell", i) for i in (7, 8, 9)))
        sids = [sid for sid, _ in started]
        for index in (7, 8, 9):
            (container,) = _containers(docker_engine, task="os_shell", index=str(index))
            assert container["State"] == "running"
        # a change the next sample's session cannot see: each session has its own container
        reply = await c.interact(sids[0], [call("bash_action", {"script": "echo mine > ~/marker; ls ~ | wc -l"})])
        reply = await c.interact(sids[1], [call("bash_action", {"script": "ls ~/marker"})])
        assert "No such file or directory" in reply.messages[0]["content"]
        for sid, index in zip(sids, (7, 8, 9)):
            await c.cancel(sid)
            assert _containers(docker_engine, task="os_shell", index=str(index)) == []
        assert c.list_sessions() == [] and task.backend.live() == []

    run(go())


def test_docker_params(docker_engine: Any, tmp_path: Any) -> None:
    with pytest.raises(FieldError, match="user='0:0' must be 'uid:gid' of a user other than root"):
        build_task("os_shell", backend="docker", user="0:0")
    with pytest.raises(FieldError, match="docker_host=5 must be a string"):
        build_task("os_shell", backend="docker", docker_host=5)
    t = build_task("os_shell", backend="docker", docker_host=f"unix://{tmp_path}/no-such.sock")
    try:
        with pytest.raises(SandboxUnavailableError, match="cannot reach a Docker daemon .*no-such.sock"):
            t.demonstration(0)
    finally:
        t.close()
