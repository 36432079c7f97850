"""The ``os_shell`` task: generated samples, expert demonstrations, grading, and escape attempts
answered with clear tool errors, in real bubblewrap sandboxes (and once through the fake Docker daemon)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from env_controller.clients.local import LocalEnvClient
from env_controller.protocol import SampleStatus
from env_controller.sandbox.bwrap import descendants, find_bwrap
from env_controller.sandbox.options import DockerOptions
from env_controller.tasks import TASKS, build_task
from env_controller.tasks.os_shell import GENERATORS, OsShellOptions, OsShellTask, answer_matches, normalize_answer
from tests.env.support import attempts_then_solve, call, replay
from tests.env.support import run_coro as run

needs_bwrap = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed: apt-get install bubblewrap (CI installs it)")


def _no_bwrap_children() -> bool:
    for pid in descendants(os.getpid()):
        try:
            if b"bwrap" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                return False
        except OSError:
            pass
    return True


@pytest.fixture
def task() -> Any:
    t = build_task("os_shell", command_timeout_s=2, max_processes=32)
    assert isinstance(t, OsShellTask)
    try:
        yield t
    finally:
        t.close()
        assert _no_bwrap_children(), "a sandbox outlived the task"


# ----------------------------------------------------------------------------------------------
# samples and grading, no sandbox needed


def test_samples_are_deterministic_varied_and_documented() -> None:
    assert TASKS["os_shell"] is OsShellTask
    a, b, other = OsShellTask(), OsShellTask(), OsShellTask(OsShellOptions(seed=1))
    assert len(a.indices()) == 300 and a.max_turns == 8
    samples = [a.sample(i) for i in a.indices()]
    assert samples == [b.sample(i) for i in b.indices()]
    assert samples != [other.sample(i) for i in other.indices()]
    kinds = Counter(s.kind for s in samples)
    assert len(kinds) == len(GENERATORS) == 12 and min(kinds.values()) == 25
    assert len({(s.prompt, json.dumps(s.files, sort_keys=True)) for s in samples}) == 300
    questions = [s for s in samples if s.answer is not None]
    changes = [s for s in samples if s.check is not None]
    assert len(questions) == 7 * 25 and len(changes) == 5 * 25 and len(questions) + len(changes) == 300
    assert "Reward" in (OsShellTask.__doc__ or "") and "check script" in (OsShellTask.__doc__ or "")
    with pytest.raises(ValueError, match="no sample index 300"):
        a.sample(300)
    with pytest.raises(ValueError, match="backend='lxc'"):
        build_task("os_shell", backend="lxc")
    with pytest.raises(ValueError, match="timeout_s=0"):
        build_task("os_shell", command_timeout_s=0)


def test_answer_matching() -> None:
    assert normalize_answer('  "42".  ') == "42" and normalize_answer("`a  b`") == "a b"
    assert answer_matches("042", "42", "int") and answer_matches("1,234", "1234", "int")
    assert not answer_matches("42 files", "42", "int") and not answer_matches("", "0", "int")
    assert answer_matches("~/files/kite_12.bin", "kite_12.bin", "filename")
    assert not answer_matches("kite_12", "kite_12.bin", "filename")
    assert answer_matches("'eu-west'", "eu-west", "text") and not answer_matches("EU-WEST", "eu-west", "text")


# ----------------------------------------------------------------------------------------------
# real sandboxes


@needs_bwrap
def test_demonstrations_replay_to_full_reward(task: OsShellTask) -> None:
    async def go() -> None:
        c = LocalEnvClient({"os_shell": task})
        for index in range(24):  # every generator twice
            demo, tools = task.demonstration(index)
            assert demo[0]["role"] == "user" and "Task: " in demo[0]["content"]
            assistant = [m for m in demo if m["role"] == "assistant"]
            assert len(assistant) == 2
            conversation, reply = await replay(c, "os_shell", index, assistant)
            assert conversation == demo
            assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 1.0
            assert reply.metrics == {"success": 1.0, "turns": 2.0, "commands": 1.0, "limit_hits": 0.0}
            assert tools == task.tools()
        assert c.list_sessions() == [] and task.backend.live() == []

    run(go())


@needs_bwrap
def test_wrong_answers_and_skipped_changes_score_zero(task: OsShellTask) -> None:
    async def go() -> None:
        c = LocalEnvClient({"os_shell": task})
        for index in range(12):
            sample = task.sample(index)
            if sample.answer is not None:
                _, reply = await replay(c, "os_shell", index, [call("answer_action", {"answer": sample.answer + "9"})])
                assert reply.messages[-1]["content"] == "wrong"
                _, reply2 = await replay(c, "os_shell", index, [call("finish_action", {})])
                assert reply2.reward == 0.0 and "use answer_action" in reply2.messages[-1]["content"]
            else:
                # shadowing the tools the check uses does not fool it: it runs in a fresh shell
                cheat = "env() { return 0; }; bash() { return 0; }; test() { return 0; }; export -f env bash test"
                _, reply = await replay(c, "os_shell", index,
                                        [call("bash_action", {"script": cheat}), call("finish_action", {})])
                assert reply.messages[-1]["content"] == "the change is not what was asked"
            assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 0.0
            assert reply.metrics["success"] == 0.0

    run(go())


@needs_bwrap
def test_escape_attempts_get_clear_tool_errors(task: OsShellTask) -> None:
    attempts = [
        ("curl -sS -m 2 http://example.com || (exec 3<>/dev/tcp/1.1.1.1/80)",
         ["Network is unreachable", "[exit code 1]"]),
        ("echo pwned > /etc/motd", ["Read-only file system", "[exit code 1]"]),
        ("touch /usr/bin/evil /outside", ["Read-only file system", "[exit code 1]"]),
        ("bomb() { bomb | bomb; }; bomb", ["error: the command reached the limit of 32 processes (a fork bomb?)"]),
        ("sleep 600", ["error: the command ran past the 2 s time limit and was killed"]),
        ("yes 'flood'", ["error: the command printed more than", "output before it was stopped:\nflood\nflood"]),
        ("python3 -c 'x = bytearray(4 << 30)'", ["MemoryError", "[exit code 1]"]),
        ("", ["error: the script is empty"]),
        ("echo a\u0000b", ["error: ", "NUL"]),
    ]

    async def go() -> None:
        c = LocalEnvClient({"os_shell": build_task("os_shell", command_timeout_s=2, max_processes=32, max_turns=12)})
        try:
            reply = await attempts_then_solve(c, 3, attempts)  # 3: sum_numbers, a question
            assert reply.metrics["limit_hits"] == 3.0
            assert Path("/etc/motd").read_text() != "pwned\n" and not Path("/outside").exists()
        finally:
            c.tasks["os_shell"].close()

    run(go())


@needs_bwrap
def test_parallel_sessions_are_independent(task: OsShellTask) -> None:
    async def one(c: LocalEnvClient, index: int) -> float:
        demo, _ = await asyncio.get_running_loop().run_in_executor(None, task.demonstration, index)
        assistant = [m for m in demo if m["role"] == "assistant"]
        sid, _ = await c.start_sample("os_shell", index)
        # leave a marker file, then make sure no other session sees it
        script = f"echo {index} > ~/marker; ls ~/marker* | wc -l"
        reply = await c.interact(sid, [call("bash_action", {"script": script})])
        assert reply.messages[0]["content"] == "1\n"
        for message in assistant:
            reply = await c.interact(sid, [message])
        return reply.reward

    async def go() -> None:
        c = LocalEnvClient({"os_shell": task})
        rewards = await asyncio.gather(*(one(c, i) for i in range(30, 38)))
        assert rewards == [1.0] * 8 and task.backend.live() == []

    run(go())


def test_on_the_docker_backend_through_the_fake_daemon(tmp_path: Path) -> None:
    pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")
    from env_controller.sandbox import SandboxLimits
    from env_controller.sandbox.docker import DockerBackend
    from tests.env.fake_docker import FakeDockerDaemon  # the fake daemon runs execs on the host

    fake = FakeDockerDaemon()
    home = tmp_path / "home"
    home.mkdir()
    try:
        backend = DockerBackend(SandboxLimits(timeout_s=5), DockerOptions(workdir=str(home)), client=fake.client())
        t = OsShellTask(backend=backend)
        for index in (0, 7, 9):  # a question, a created file, renamed files
            shutil.rmtree(home)  # one host directory stands for every container's tmpfs home
            home.mkdir()
            demo, _ = t.demonstration(index)
            assert demo[-1]["content"] in ("correct", "the change is correct"), demo
        t.close()
        backend.close()
        assert not fake.containers
    finally:
        fake.stop()


@needs_bwrap
def test_tmp_mb_sizes_each_sandboxs_tmp() -> None:
    """``tmp_mb`` (a container option of the task) is the size of each sandbox's ``/tmp``: the agent's write past it
    is told, naming the size; a bad value is refused naming the key."""
    t = build_task("os_shell", tmp_mb=4, command_timeout_s=5)
    try:
        assert isinstance(t, OsShellTask) and t.limits.tmp_mb == 4
        session, _ = run(t.start(3))
        reply = run(session.interact(call("bash_action", {"script": "head -c 8M /dev/zero > /tmp/big; echo done"})))
        assert "/tmp is full (its size limit is 4 MB)" in reply.messages[0]["content"], reply
        run(session.close())
    finally:
        t.close()
    with pytest.raises(ValueError, match=r"os_shell.tmp_mb=0 must be a positive integer"):
        build_task("os_shell", tmp_mb=0)
