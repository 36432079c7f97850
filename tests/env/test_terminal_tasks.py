"""The ``terminal`` task on a real Docker engine (a private dockerd started by the tests): instances with their
own image (built from a Dockerfile context, imported from a root-filesystem tarball), a verifier run in the
container whose exit code (or reward file) decides the reward, a hanging verifier cut at its timeout as a failed
episode (or, by choice, a task error), per-image pools serving at once under one cap, a reuse only after a verified
wipe, and no container left behind. The format's refusals are checked without an engine."""
from __future__ import annotations

import asyncio
import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from env_controller.clients.local import LocalEnvClient
from env_controller.options import FieldError
from env_controller.protocol import SampleStatus
from env_controller.sandbox.docker import LABEL
from env_controller.sandbox.docker_image import ImageBuildError, build_rootfs
from env_controller.sandbox.task_images import ImageCache, ImageSource
from env_controller.tasks import build_task
from env_controller.tasks.terminal import TerminalTask
from env_controller.tasks.terminal_format import TaskFormatError, load_tasks
from tests.env.support import call, replay

pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")

SOLVE = "echo done > out.txt"
CHECK = '[ "$(cat /app/out.txt)" = done ]'


def _containers(engine: Any) -> list[Any]:
    """The task's containers, from the engine's list alone (sparse: no inspect per container, which fails with
    404 for one the pool removes meanwhile)."""
    client = engine.client()
    try:
        return client.containers.list(all=True, sparse=True,
                                      filters={"label": [f"{LABEL}=1", "agentrl.task=terminal"]})
    finally:
        client.close()


def _harbor_task(root: Path, base_image: str, name: str = "hello", test: str = CHECK, timeout: float = 20) -> Path:
    """A Harbor-layout task whose image is built FROM ``base_image`` (the OS task's, imported here)."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(f'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = '
                                 f'{timeout}\n[agent]\ntimeout_sec = 60.0\n[environment]\ncpus = 1\nmemory_mb = 256\n')
    (d / "instruction.md").write_text("Write the word done into /app/out.txt.\n")
    (d / "environment" / "Dockerfile").write_text(
        f"FROM {base_image}\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\nRUN chown -R 1000:1000 /app\n")
    (d / "environment" / "seed.txt").write_text("seed\n")
    (d / "tests" / "test.sh").write_text(test + "\n")
    (d / "solution" / "solve.sh").write_text(SOLVE + "\n")
    return d


def _rootfs_tarball(path: Path, scratch: Path) -> Path:
    """A root filesystem (host bash and coreutils, ``/app`` owned by uid 1000) as a .tar.gz for ``docker import``."""
    root = scratch / "rootfs"
    build_rootfs(root, ("bash", "cat", "echo", "ls", "sleep", "mkdir", "rm", "touch", "test", "env", "head", "wc"))
    (root / "app").mkdir()
    (root / "app" / "input.txt").write_text("3\n")
    with tarfile.open(path, "w:gz") as tar:
        def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
            if info.name == "app" or info.name.startswith("app/"):
                info.uid = info.gid = 1000
            return info
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=owner)
    return path


@pytest.fixture(scope="module")
def task_set(docker_engine: Any, os_shell_image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manifest: a Harbor directory (Dockerfile), and rootfs instances judged by exit code, by reward.json,
    one whose verifier hangs, one that allows reuse."""
    root = tmp_path_factory.mktemp("terminal_tasks")
    _harbor_task(root, os_shell_image)
    _rootfs_tarball(root / "base.tar.gz", tmp_path_factory.mktemp("scratch"))
    rootfs = {"rootfs": "base.tar.gz"}
    manifest = {"tasks": [
        {"path": "hello"},
        {"id": "double", "instruction": "Write twice the number in input.txt into answer.txt.", "image": rootfs,
         "setup": ["touch started"], "solution": "echo 6 > answer.txt",
         "verifier": {"script": '[ -f /app/started ] && [ "$(cat /app/answer.txt)" = 6 ]', "timeout_s": 20},
         "family": "arith"},
        {"id": "partial", "instruction": "Anything.", "image": rootfs, "solution": "true",
         "verifier": {"script": 'echo \'{"reward": 0.25, "passed": 1, "total": 4}\' > /logs/verifier/reward.json; '
                                "exit 1", "timeout_s": 20}},
        {"id": "hang", "instruction": "Anything.", "image": rootfs, "solution": "true",
         "verifier": {"script": "sleep 1000", "timeout_s": 2}},
        {"id": "reusable", "instruction": "Look around.", "image": rootfs, "solution": "ls /app > /tmp/seen",
         # what the verifier leaves in its home and temporary directory does not bar a reuse
         "reuse_containers": True, "verifier": {"script": "touch $HOME/x $TMPDIR/y", "timeout_s": 20}},
        {"id": "disk", "instruction": "Fill the disk.", "image": rootfs, "storage_mb": 16,
         "verifier": {"script": "true", "timeout_s": 20}},
        {"id": "scratch", "instruction": "Work in a scratch directory.", "image": rootfs, "setup": ["echo x > seed"],
         "reuse_containers": True, "scratch_workdir": True,
         # what the episode found in /app at its start: only the setup's file, never an earlier session's
         "verifier": {"script": '[ "$(cat /tmp/found)" = seed ]', "timeout_s": 20}},
    ]}
    (root / "tasks.yaml").write_text(json.dumps(manifest))
    return root / "tasks.yaml"


@pytest.fixture
def task(docker_engine: Any, task_set: Path) -> Iterator[TerminalTask]:
    t = build_task("terminal", tasks=str(task_set), docker_host=docker_engine.url, max_containers=6,
                   warm_containers="0:2", command_timeout_s=5, memory_mb=128)
    assert isinstance(t, TerminalTask)
    try:
        yield t
    finally:
        t.close()
        assert _containers(docker_engine) == [], "a container outlived the task"


def _index(task: TerminalTask, id_: str) -> int:
    return next(i for i, inst in enumerate(task.instances) if inst.id == id_)


def test_dockerfile_and_rootfs_images_run_and_the_verifier_decides(task: TerminalTask) -> None:
    async def go() -> None:
        c = LocalEnvClient({"terminal": task})
        for id_ in ("hello", "double"):
            i = _index(task, id_)
            solution = task.instances[i].solution
            _, reply = await replay(c, "terminal", i, [call("bash_action", {"script": solution}),
                                                       call("finish_action", {})])
            assert reply.status is SampleStatus.COMPLETED and reply.reward == 1.0, (id_, reply)
            assert reply.metrics["verifier_exit_code"] == 0.0 and reply.metrics["success"] == 1.0
            # finishing at once: the verifier exits non-zero, a reward of 0, completed
            _, reply = await replay(c, "terminal", i, [call("finish_action", {})])
            assert reply.status is SampleStatus.COMPLETED and reply.reward == 0.0, (id_, reply)
            assert reply.metrics["verifier_exit_code"] != 0.0
        # reward.json wins over the exit code; its other numbers become metrics
        _, reply = await replay(c, "terminal", _index(task, "partial"), [call("finish_action", {})])
        assert reply.status is SampleStatus.COMPLETED and reply.reward == 0.25, reply
        assert reply.metrics["verifier/passed"] == 1.0 and reply.metrics["verifier/total"] == 4.0
        assert reply.metrics["verifier_exit_code"] == 1.0

    asyncio.run(go())
    images = {s["image"] for s in task.sandbox_pool().stats()["images"].values()}
    assert any(t.startswith("agentrl/task:d-") for t in images) and any(t.startswith("agentrl/task:r-") for t in images)


def test_a_hanging_verifier_is_cut_at_its_timeout_and_fails_the_episode(task: TerminalTask,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier ran the agent's work: work that hangs its tests fails them (reward 0), never leaves the episode out
    of training, or an agent could escape every 0 that way. ``verifier_limit: error`` reads it as a task error."""
    async def go() -> Any:
        c = LocalEnvClient({"terminal": task})
        t0 = time.monotonic()
        _, reply = await replay(c, "terminal", _index(task, "hang"), [call("finish_action", {})])
        return reply, time.monotonic() - t0

    reply, took = asyncio.run(go())
    assert reply.finish and reply.status is SampleStatus.COMPLETED and reply.reward == 0.0, reply
    assert "ran past its timeout of 2 s" in reply.error and reply.metrics["verifier_limit_hit"] == 1.0
    assert took < 15
    monkeypatch.setattr(task.options, "verifier_limit", "error")
    reply, _ = asyncio.run(go())
    assert reply.finish and reply.status is SampleStatus.TASK_ERROR, reply  # left out, never a reward of 0
    assert "ran past its timeout of 2 s" in reply.error and "verifier_limit: error" in reply.error


def test_a_demonstration_that_meets_an_infrastructure_failure_is_played_again_never_kept(
        task: TerminalTask, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The warm-up's demonstrations are played in containers; a verifier cut at its timeout (a busy machine) is the
    infrastructure's failure, not the player's: the play is repeated, and after the last attempt the error says so
    and nothing is cached (the next call plays again), never a conversation that ends in the error."""
    import env_controller.tasks.terminal as terminal

    monkeypatch.setattr(terminal, "DEMO_RETRY_PAUSE_S", 0.0)
    monkeypatch.setattr(terminal, "DEMO_ATTEMPTS", 2)  # each attempt waits out the verifier's 2 s timeout
    hang = _index(task, "hang")
    with caplog.at_level("WARNING", logger="env_controller.tasks.terminal"):
        with pytest.raises(terminal.DemonstrationUnavailable,
                           match=f"failed {terminal.DEMO_ATTEMPTS} times.*infrastructure"):
            task.careless_demonstration(hang)
    again = [r for r in caplog.records if "playing it again" in r.getMessage()]
    assert len(again) == terminal.DEMO_ATTEMPTS - 1, [r.getMessage() for r in caplog.records]
    caplog.clear()
    with pytest.raises(terminal.DemonstrationUnavailable):
        task.careless_demonstration(hang)  # played again, not the cached failure
    assert any("playing it again" in r.getMessage() for r in caplog.records)
    conversation, _ = task.careless_demonstration(_index(task, "double"))
    assert conversation[-1]["content"].startswith("the tests failed")


def test_two_images_pools_serve_at_once_under_one_cap(task: TerminalTask, docker_engine: Any) -> None:
    hello, double = _index(task, "hello"), _index(task, "double")

    async def go() -> dict[str, Any]:
        opened = await asyncio.gather(*(task.start(i) for i in (hello, double, hello, double)))
        stats = task.sandbox_pool().stats()
        assert len(_containers(docker_engine)) >= 4
        replies = await asyncio.gather(*(s.interact(call("finish_action", {})) for s, _ in opened))
        for s, _ in opened:
            await s.close()
        assert all(r.finish and r.status is SampleStatus.COMPLETED for r in replies)
        return stats

    stats = asyncio.run(go())
    per_image = [s for s in stats["images"].values() if s["leased"]]
    assert len(per_image) == 2 and all(s["leased"] == 2 for s in per_image), stats
    assert stats["max"] == 6 and stats["budget"]["used"] <= 6 and stats["leased"] == 4
    for s in per_image:
        assert s["start_s"]["n"] >= 1 and s["start_s"]["p50"] > 0  # the start latency, per image


def test_an_instances_storage_mb_caps_its_containers_own_files(task: TerminalTask) -> None:
    """An instance's ``storage_mb`` (Harbor's ``[environment] storage_mb``) caps what its container writes outside
    /tmp: the agent is told, in the command's reply, and can delete files and go on."""
    i = _index(task, "disk")

    async def go() -> tuple[Any, Any]:
        session, _ = await task.start(i)
        full = await session.interact(call("bash_action", {"script": "for i in 1 2 3 4 5 6; do "
                                                                       "head -c 3M /dev/zero > /app/f$i; done"}))
        freed = await session.interact(call("bash_action", {"script": "rm /app/f*; echo freed"}))
        await session.close()
        return full, freed

    full, freed = asyncio.run(go())
    assert "more than its limit of 16 MB" in full.messages[0]["content"], full
    assert "freed" in freed.messages[0]["content"] and "limit" not in freed.messages[0]["content"], freed


def test_reuse_only_after_a_verified_wipe(task: TerminalTask) -> None:
    i = _index(task, "reusable")

    async def episode(script: str) -> None:
        session, _ = await task.start(i)
        await session.interact(call("bash_action", {"script": script}))
        reply = await session.interact(call("finish_action", {}))
        assert reply.reward == 1.0, reply
        await session.close()

    async def go() -> None:
        await episode("ls /app > /tmp/seen")  # /tmp is wiped: reused
        await episode("touch /app/changed")   # the image's files changed: docker diff refuses the reuse

    asyncio.run(go())
    (stats,) = [s for s in task.sandbox_pool().stats()["images"].values() if s["reused"] or s["wipe_failures"]]
    assert stats["reused"] >= 1 and stats["wipe_failures"] == 1, stats


def test_a_scratch_workdir_is_emptied_and_its_container_reused(docker_engine: Any, task_set: Path) -> None:
    """A session that wrote in a scratch working directory leaves a reusable container, and the next session in
    it finds only what its own setup put there (one container at most: the second session gets the first's)."""
    task = build_task("terminal", tasks=str(task_set), docker_host=docker_engine.url, max_containers=1,
                      warm_containers=1, prebuild=False, command_timeout_s=5, memory_mb=128)
    assert isinstance(task, TerminalTask)
    i = _index(task, "scratch")
    boxes: list[str] = []

    async def go() -> None:
        for _ in range(2):
            session, _ = await task.start(i)
            boxes.append(session.sandbox.id)
            seen = await session.interact(call("bash_action", {"script": "ls -A > /tmp/found; mkdir out; touch out/x"}))
            reply = await session.interact(call("finish_action", {}))
            assert reply.reward == 1.0, (boxes, seen, reply)
            await session.close()
            deadline = time.monotonic() + 60  # the release (the wipe) runs after close returns
            while session.pool.stats()["idle"] < 1:
                assert time.monotonic() < deadline, session.pool.stats()
                await asyncio.sleep(0.05)

    try:
        asyncio.run(go())
        (stats,) = [s for key, s in task.sandbox_pool().stats()["images"].items() if " scratch" in key]
        assert boxes[0] == boxes[1] and stats["reused"] == 2 and stats["wipe_failures"] == 0, (boxes, stats)
    finally:
        task.close()
    assert _containers(docker_engine) == [], "a container outlived the task"


def test_a_reward_or_tests_planted_by_the_agent_never_judge_it(docker_engine: Any, os_shell_image: str,
                                                                 tmp_path: Path) -> None:
    """An image that lets the session's user write /logs and /tests: the agent plants a reward of 1 and a test of
    its own, then finishes without doing the task; the task's verifier alone judges it (reward 0)."""
    d = _harbor_task(tmp_path, os_shell_image, name="open", test=CHECK)
    (d / "environment" / "Dockerfile").write_text(
        f"FROM {os_shell_image}\nRUN mkdir -m 1777 /logs /tests\nWORKDIR /app\nRUN chown -R 1000:1000 /app\n")
    task = build_task("terminal", tasks=str(d), docker_host=docker_engine.url, max_containers=1,
                      warm_containers=0, prebuild=False, command_timeout_s=5, memory_mb=128)
    assert isinstance(task, TerminalTask)
    plant = ("mkdir -p /logs/verifier/deep /tests && echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
             "echo 1 > /logs/verifier/reward.txt && echo 'exit 0' > /tests/test.sh && chmod 0 /logs/verifier/deep && "
             "ls /logs/verifier /tests")

    async def go() -> tuple[Any, Any]:
        c = LocalEnvClient({"terminal": task})
        planted = await replay(c, "terminal", 0, [call("bash_action", {"script": plant}), call("finish_action", {})])
        solved = await replay(c, "terminal", 0, [call("bash_action", {"script": plant + "; " + SOLVE}),
                                                 call("finish_action", {})])
        return planted[1], solved[1]

    try:
        planted, solved = asyncio.run(go())
    finally:
        task.close()
    assert planted.status is SampleStatus.COMPLETED and planted.reward == 0.0, planted
    assert planted.metrics["verifier_exit_code"] != 0.0
    assert solved.status is SampleStatus.COMPLETED and solved.reward == 1.0, solved  # the real test still runs
    assert _containers(docker_engine) == [], "a container outlived the task"


#: Harbor's test.sh template, reduced to what runs offline: uv's installer's env file from HOME, a venv in the
#: working directory, then the test, which writes the reward (with who ran it, and the modes of its directories)
HARBOR_TEMPLATE = """source $HOME/.local/bin/env 2>/dev/null
if [ "$PWD" = / ]; then echo "no working directory"; exit 1; fi
source .tbench-testing/bin/activate 2>/dev/null
if [ "$(cat /app/out.txt)" = done ]; then r=1; else r=0; fi
logs=$(stat -c '%u.%a' /logs/verifier) tests=$(stat -c '%u.%a' /tests)
echo "{\\"reward\\": $r, \\"uid\\": $(id -u), \\"logs\\": $logs, \\"tests\\": $tests}" > /logs/verifier/reward.json"""
#: what an agent plants for the template to run as the verifier: a reward of 1, then the end of the script
FORGE = "printf 'echo 1 > /logs/verifier/reward.txt; exit 0\\n'"


def test_code_planted_in_home_or_beside_the_work_never_runs_as_the_verifier(docker_engine: Any, os_shell_image: str,
                                                                             tmp_path: Path) -> None:
    """The agent plants what Harbor's template would run, in its HOME (uv's env file) and beside its work (the
    venv's activate script), then finishes without doing the task: the verifier, its own user in its own home,
    runs neither (reward 0). A solved episode with the same plants still gets 1, and the verifier ran as
    ``verifier_user``, with its reward directory its own and the tests root's, neither writable by others."""
    _harbor_task(tmp_path, os_shell_image, name="template", test=HARBOR_TEMPLATE)
    task = build_task("terminal", tasks=str(tmp_path / "template"), docker_host=docker_engine.url, max_containers=2,
                      warm_containers=0, prebuild=False, command_timeout_s=5, memory_mb=128, verifier_user="1234:1234")
    assert isinstance(task, TerminalTask)
    in_home = f"mkdir -p ~/.local/bin && {FORGE} > ~/.local/bin/env"
    beside = f"mkdir -p .tbench-testing/bin && {FORGE} > .tbench-testing/bin/activate"

    async def go() -> list[Any]:
        c = LocalEnvClient({"terminal": task})
        out = []
        for script in (in_home, beside, f"{in_home} && {beside} && {SOLVE}"):
            _, reply = await replay(c, "terminal", 0, [call("bash_action", {"script": script}),
                                                        call("finish_action", {})])
            out.append(reply)
        return out

    try:
        home, work, solved = asyncio.run(go())
    finally:
        task.close()
    for reply in (home, work):
        assert reply.status is SampleStatus.COMPLETED and reply.reward == 0.0, reply
    assert solved.status is SampleStatus.COMPLETED and solved.reward == 1.0, solved
    assert solved.metrics["verifier/uid"] == 1234.0, solved.metrics
    # uid.mode: the verifier's 755, root's 755
    assert solved.metrics["verifier/logs"] == 1234.755 and solved.metrics["verifier/tests"] == 0.755, solved.metrics
    assert _containers(docker_engine) == [], "a container outlived the task"


def test_the_verifier_user_is_checked() -> None:
    for bad, why in (("0:0", "other than root"), ("1000:5", "must differ from user"), ("7:1000", "must differ"),
                     ("me", "uid:gid")):
        with pytest.raises(FieldError, match=why):
            build_task("terminal", demo="files", verifier_user=bad)


def test_builds_need_their_base_in_the_engine(docker_engine: Any, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM ubuntu:22.04\nRUN true\n")
    client = docker_engine.client()
    images = ImageCache(client)
    try:
        with pytest.raises(ImageBuildError, match="FROM ubuntu:22.04: that image is not in the Docker engine, and "
                                                  "builds here pull nothing"):
            images.ensure(ImageSource.from_dockerfile(tmp_path))
        with pytest.raises(ImageBuildError, match="not in the Docker engine"):
            images.ensure(ImageSource.from_tag("nope/missing:1"))
    finally:
        images.close()
        client.close()


def test_the_demo_families_images_and_experts(docker_engine: Any) -> None:
    for family in ("files", "copy", "count"):
        t = build_task("terminal", demo=family, num_samples=3, docker_host=docker_engine.url)
        assert isinstance(t, TerminalTask)
        try:
            conversation, tools = t.demonstration(1)  # checked to pass its verifier
            assert conversation[-1]["content"] == "the tests passed"
            careless, _ = t.careless_demonstration(1)
            assert careless[-1]["content"].startswith("the tests failed")
            assert t.demonstration(1) is t.demonstration(1)  # played once, cached
        finally:
            t.close()
    assert _containers(docker_engine) == []


# -- the format's refusals (no engine) ---------------------------------------------------------------


def test_terminal_bench_1_layout_and_refusals(tmp_path: Path) -> None:
    tb1 = tmp_path / "tb1" / "hello-world"
    (tb1 / "tests").mkdir(parents=True)
    (tb1 / "task.yaml").write_text("instruction: |\n  Create hello.txt.\ndifficulty: easy\ncategory: files\n"
                                   "max_test_timeout_sec: 30\nparser_name: pytest\n")
    (tb1 / "Dockerfile").write_text("FROM scratch\n")
    (tb1 / "docker-compose.yaml").write_text("services:\n  client:\n    build: .\n")
    (tb1 / "run-tests.sh").write_text("bash $TEST_DIR/check.sh\n")
    (tb1 / "tests" / "check.sh").write_text("test -f hello.txt\n")
    (tb1 / "solution.sh").write_text("touch hello.txt\n")
    (inst,) = load_tasks(str(tmp_path / "tb1"))
    assert inst.id == "hello-world" and inst.verifier.timeout_s == 30 and inst.family == "files"
    assert set(inst.verifier.files) == {"run-tests.sh", "check.sh"} and inst.solution == "touch hello.txt\n"
    assert inst.image.kind == "dockerfile" and inst.verifier.command == "bash /tests/run-tests.sh"

    (tb1 / "docker-compose.yaml").write_text("services:\n  client: {build: .}\n  db: {image: postgres}\n")
    with pytest.raises(TaskFormatError, match="2 services: multi-container tasks are not supported"):
        load_tasks(str(tb1))

    harbor = _harbor_task(tmp_path, "scratch", name="net")
    toml = harbor / "task.toml"
    toml.write_text(toml.read_text() + "allow_internet = true\n")
    with pytest.raises(TaskFormatError, match="allow_internet = true: containers here have no network"):
        load_tasks(str(harbor))
    harbor = _harbor_task(tmp_path, "scratch", name="asuser")
    toml = harbor / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nuser = "agent"\n'))
    with pytest.raises(TaskFormatError, match="user = 'agent': the verifier runs as a user of its own"):
        load_tasks(str(harbor))
    harbor = _harbor_task(tmp_path, "scratch", name="notest")
    (harbor / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFormatError, match="tests/test.sh is missing"):
        load_tasks(str(harbor))
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"tasks": [{"id": "x", "instruction": "y", "image": {"name": "a:b"},
                                          "verifier": {"script": "true"}, "timeout": 3}]}))
    with pytest.raises(TaskFormatError, match="'timeout' is not a field of an instance"):
        load_tasks(str(bad))
    with pytest.raises(FieldError, match="give exactly one of tasks"):
        build_task("terminal")
    with pytest.raises(FieldError, match="user=.*other than root"):
        build_task("terminal", demo="files", user="0:0")


def test_put_files_tar_is_rooted(tmp_path: Path) -> None:
    """What put_files sends: the directory, those below it and the files, owned by the user, and never the
    directory's parents (the engine makes missing ones root's and keeps existing ones; no engine needed)."""
    from env_controller.sandbox.docker import DockerSandbox

    sent: list[bytes] = []

    class _C:
        id = "c" * 64

        def put_archive(self, path: str, data: bytes) -> bool:
            assert path == "/"
            sent.append(data)
            return True

    box = object.__new__(DockerSandbox)
    box.id, box.container = "x", _C()

    class _B:
        uid, gid = 1000, 1000

    box._backend, box._errors = _B(), __import__("docker").errors
    box.put_files("/logs/tests", {"test.sh": "true\n", "data/a.txt": b"a"})
    with tarfile.open(fileobj=io.BytesIO(sent[0])) as tar:
        names = {m.name: m for m in tar.getmembers()}
    assert set(names) == {"logs/tests", "logs/tests/data", "logs/tests/test.sh", "logs/tests/data/a.txt"}
    assert all(m.uid == 1000 for m in names.values()) and names["logs/tests"].isdir()
    with pytest.raises(ValueError, match="not a relative path"):
        box.put_files("/tests", {"../etc/passwd": "x"})


# -- one cap over every image's pool (max_containers) ------------------------------------------------


class _Watch:
    """Samples, on its own thread, the task's containers in the engine and the budget's units, keeping the most
    seen of each (the cap must hold at every moment, not only at the end)."""

    def __init__(self, engine: Any, task: TerminalTask) -> None:
        import threading

        self.engine, self.task = engine, task
        self.max_docker = self.max_used = self.max_live = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = self.engine.client()
        try:
            while not self._stop.is_set():
                # sparse: no inspect per container (one removed meanwhile would fail the listing)
                n = len(client.containers.list(all=True, sparse=True,
                                               filters={"label": [f"{LABEL}=1", "agentrl.task=terminal"]}))
                used = self.task.budget.stats()["used"] if self.task.budget is not None else 0
                live = sum(p.stats()["live"] for p in self.task.pools().values())
                self.max_docker, self.max_used = max(self.max_docker, n), max(self.max_used, used)
                self.max_live = max(self.max_live, live)
                self.samples += 1
                self._stop.wait(0.02)
        finally:
            client.close()

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        assert self.samples >= 10, "the watch took too few samples"


def _capped_task(engine: Any, task_set: Path, **kw: Any) -> TerminalTask:
    params: dict[str, Any] = {"max_containers": 2, "warm_containers": 2, "prebuild": False, "command_timeout_s": 5,
                              "memory_mb": 128, "acquire_timeout_s": 10, **kw}
    t = build_task("terminal", tasks=str(task_set), docker_host=engine.url, **params)
    assert isinstance(t, TerminalTask)
    return t


def _wait_for(what: str, cond: Any, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"not within {limit:g} s: {what}"
        time.sleep(0.05)


def _warm_pool(task: TerminalTask, id_: str) -> Any:
    """The pool of instance ``id_``'s image, made now, once its warm containers fill the cap."""
    inst = task.instances[_index(task, id_)]
    pool = task.pool_for(task.images.ensure(inst.image), inst)
    _wait_for(f"{id_}'s pool warm", lambda: pool.stats()["idle"] == task.max_containers)
    return pool


def test_a_session_of_another_image_evicts_an_idle_container_under_the_cap(docker_engine: Any,
                                                                          task_set: Path) -> None:
    task = _capped_task(docker_engine, task_set)
    try:
        pool_a = _warm_pool(task, "hello")  # image A's idle containers fill the cap of 2
        assert task.budget is not None and task.budget.stats()["used"] == 2
        assert len(_containers(docker_engine)) == 2
        double = _index(task, "double")  # image B

        async def go() -> tuple[list[float], list[Any]]:
            took, opened, a_idle = [], [], []
            for _ in range(2):  # the first evicts one of A's two idle containers, the second the other
                t0 = time.monotonic()
                opened.append(await task.start(double))
                took.append(time.monotonic() - t0)
                await asyncio.sleep(1.0)  # refill ticks: a waiting session takes one container from A, not more
                a_idle.append(pool_a.stats()["idle"])
            assert a_idle == [1, 0], a_idle
            replies = [await s.interact(call("finish_action", {})) for s, _ in opened]
            for s, _ in opened:
                await s.close()
            return took, replies

        with _Watch(docker_engine, task) as watch:
            took, replies = asyncio.run(go())
            time.sleep(1.0)  # the pools' refill ticks after the sessions: still under the cap
        assert all(r.finish and r.status is SampleStatus.COMPLETED for r in replies), replies
        assert all(t < 8 for t in took), took  # evicted on the next refill tick, not after the acquire timeout
        a = pool_a.stats()
        assert a["removed"] >= 2 and a["timeouts"] == 0, a
        stats = task.sandbox_pool().stats()
        assert stats["timeouts"] == 0 and stats["budget"]["peak"] <= 2, stats
        assert watch.max_docker <= 2 and watch.max_used <= 2 and watch.max_live <= 2, vars(watch)
        print(f"B sessions started in {[round(t, 2) for t in took]} s; A created {a['created']} removed "
              f"{a['removed']}; most containers seen {watch.max_docker}")
    finally:
        task.close()
    assert _containers(docker_engine) == [], "a container outlived the task"


def test_at_the_cap_with_busy_containers_a_session_waits_for_a_release_or_times_out(docker_engine: Any,
                                                                                 task_set: Path) -> None:
    from env_controller.sandbox.pool import PoolExhaustedError

    task = _capped_task(docker_engine, task_set, warm_containers=0, acquire_timeout_s=3)
    try:
        hello, double = _index(task, "hello"), _index(task, "double")

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {}
            held = [await task.start(hello), await task.start(double)]  # both images, every unit busy
            # none is released: the session fails after its timeout, with the error naming the cap
            t0 = time.monotonic()
            with pytest.raises(PoolExhaustedError, match=r"all 2 allowed by max_containers .* are live over all "
                                                          r"pools \(2 units used; this pool: 1 held"):
                await task.start(hello)
            out["timeout_s"] = time.monotonic() - t0
            # through a client: an infrastructure failure (task error), never a judged reward
            c = LocalEnvClient({"terminal": task})
            _, reply = await c.start_sample("terminal", double)
            out["client_reply"] = reply
            # one released a second into the wait: the waiting session (another image's) starts at once
            waiter = asyncio.ensure_future(task.start(double))
            await asyncio.sleep(1.0)
            assert not waiter.done()
            released = time.monotonic()
            await held[0][0].close()
            session, _ = await asyncio.wait_for(waiter, 10)
            out["after_release_s"] = time.monotonic() - released
            reply = await session.interact(call("finish_action", {}))
            assert reply.finish and reply.status is SampleStatus.COMPLETED, reply
            await session.close()
            await held[1][0].close()
            return out

        with _Watch(docker_engine, task) as watch:
            out = asyncio.run(go())
        assert 2.5 <= out["timeout_s"] < 6, out
        reply = out["client_reply"]
        assert reply.finish and reply.status is SampleStatus.TASK_ERROR and reply.reward == 0.0, reply
        assert out["after_release_s"] < 5, out
        stats = task.sandbox_pool().stats()
        assert stats["timeouts"] == 2 and stats["waited"] >= 3, stats
        assert watch.max_docker <= 2 and watch.max_used <= 2 and watch.max_live <= 2, vars(watch)
        print(f"timed out after {out['timeout_s']:.2f} s; started {out['after_release_s']:.2f} s after a release")
    finally:
        task.close()
    assert _containers(docker_engine) == [], "a container outlived the task"
