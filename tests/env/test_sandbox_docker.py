"""The docker sandbox backend against a fake Docker daemon speaking the Engine HTTP API on a unix socket.

The real ``docker`` SDK talks to :class:`FakeDockerDaemon` exactly as to dockerd: container
create/start/inspect/list/delete and exec create/start (attached, with the raw-stream upgrade
and multiplexed frames). The fake keeps containers in memory and runs each exec as a host
process in the sandbox's working directory (the test points ``workdir`` at a temporary
directory), so the persistent shell, limits and restarts run for real. Only the attached shell
runs: the backend's other execs read or kill inside a container, and must never run on the host.
The one that kills all the user's processes is emulated by killing the process groups started for
that container; the others (counts, the ending of background processes, free space) print nothing,
so the backend sees unknown counts, as with an engine whose cgroups it cannot read.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")

from env_controller.sandbox import SandboxLimits, SandboxUnavailableError, make_backend  # noqa: E402
from env_controller.sandbox.docker import (  # noqa: E402
    BASE_PROCESSES,
    CREATED_LABEL,
    KILL_SCRIPT,
    LABEL,
    OWNER_LABEL,
    SHELL_CMD,
    DockerBackend,
    owner_id,
)
from env_controller.sandbox.options import DockerOptions  # noqa: E402
from tests.env.fake_docker import FakeDockerDaemon  # noqa: E402


@pytest.fixture
def fake() -> Any:
    daemon = FakeDockerDaemon()
    try:
        yield daemon
    finally:
        daemon.stop()


LIMITS = SandboxLimits(
    timeout_s=2, max_processes=32, max_output_bytes=4096, memory_mb=256, tmp_mb=16, start_timeout_s=10
)


def _backend(fake: FakeDockerDaemon, home: Path, **kw: Any) -> DockerBackend:
    home.mkdir(exist_ok=True)
    return DockerBackend(LIMITS, DockerOptions(image="agentrl/sandbox:test", workdir=str(home), **kw),
                         client=fake.client())


def test_create_labels_limits_exec_and_remove(fake: FakeDockerDaemon, tmp_path: Path) -> None:
    backend = _backend(fake, tmp_path / "home")
    box = backend.create(labels={"task": "os_shell"})
    (cid, c), = fake.containers.items()
    assert c["running"] and c["name"] == box.id
    cfg = c["config"]
    assert cfg["Image"] == "agentrl/sandbox:test" and cfg["Cmd"] == ["sleep", "infinity"]
    labels = cfg["Labels"]
    assert labels["task"] == "os_shell" and labels[LABEL] == "1" and labels[OWNER_LABEL] == owner_id()
    assert abs(int(labels[CREATED_LABEL]) - time.time()) < 60
    hc = cfg["HostConfig"]
    assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True and hc["Init"] is True
    assert hc["Memory"] == 256 << 20 and hc["MemorySwap"] == 256 << 20 and hc["PidsLimit"] == 32 + BASE_PROCESSES
    assert hc["NanoCpus"] == 10**9
    assert hc["CapDrop"] == ["ALL"] and hc["SecurityOpt"] == ["no-new-privileges"]
    assert set(hc["Tmpfs"]) == {"/tmp", str(tmp_path / "home")} and "size=16m" in hc["Tmpfs"]["/tmp"]
    assert {u["Name"] for u in hc["Ulimits"]} == {"fsize", "core"}
    # the shell is one attached exec of bash, as the unprivileged user
    execs = [b for m, p, b in fake.log if m == "POST" and p.endswith("/exec")]
    assert execs[0]["Cmd"] == SHELL_CMD and execs[0]["User"] == "1000:1000"
    assert execs[0]["AttachStdin"] is True and execs[0]["Tty"] is False
    assert box._channel is not None and box._channel.shell_pid is not None  # its first line, not output

    box.copy_in({"data/a.txt": "one\ntwo\n"})
    assert box.run("cd data && export GREETING=hi").ok
    r = box.run("pwd; echo $GREETING; wc -l < a.txt; echo oops >&2; false")
    assert r.output == f"{tmp_path / 'home' / 'data'}\nhi\n2\noops\n" and r.exit_code == 1 and r.limit is None
    shells = [b for m, p, b in fake.log if m == "POST" and p.endswith("/exec") and b.get("AttachStdin")]
    assert len(shells) == 1  # same shell throughout
    # the fake's counts are unknown: the backend says how it counts, and nothing else is missing
    health = backend.health()
    assert health["counting"] == "exec" and health["engine"] == "Docker 24.0.0-fake, cgroup v2 (fake)"
    assert [w for w in health["warnings"] if "not visible from this process" not in w] == []

    box.close()
    assert ("DELETE", f"/containers/{cid}", None) in fake.log and not fake.containers
    assert all(p.poll() is not None for p in fake.processes())
    backend.close()


def test_limits_kill_and_restart_the_shell(fake: FakeDockerDaemon, tmp_path: Path) -> None:
    backend = _backend(fake, tmp_path / "home")
    with backend.create() as box:
        box.run("cd /; export X=1")
        started = time.monotonic()
        r = box.run("sleep 60")
        assert r.limit == "timeout" and r.restarted and r.exit_code is None
        assert "2 s time limit" in r.error and time.monotonic() - started < 10
        kills = [b for m, p, b in fake.log if m == "POST" and p.endswith("/exec")
                 and b["Cmd"][:3] == ["bash", "-c", KILL_SCRIPT] and b["Cmd"][4] == "0"]
        assert len(kills) == 1 and kills[0]["User"] == "1000:1000" and kills[0]["Cmd"][5] == "1000"
        # the sleep died with the old shell; the new shell starts in the home with a clean environment
        assert sum(p.poll() is None for p in fake.processes()) == 1
        r = box.run("pwd; echo ${X:-unset}")
        assert r.output == f"{tmp_path / 'home'}\nunset\n"

        r = box.run("yes")
        assert r.limit == "output_limit" and len(r.output) == 4096 and r.truncated and "4096 bytes" in r.error
        r = box.run("exit 7")
        assert r.limit == "shell_exited" and "shell exited" in r.error
        assert box.run("echo back").output == "back\n"
    assert not fake.containers and all(p.poll() is not None for p in fake.processes())
    backend.close()


def test_reaping_of_leaked_containers(fake: FakeDockerDaemon, tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    now = int(time.time())
    leaked = fake.add_container("leaked", {LABEL: "1", OWNER_LABEL: owner_id(dead.pid), CREATED_LABEL: str(now)})
    stopped = fake.add_container("leaked-stopped", {LABEL: "1", OWNER_LABEL: "bogus", CREATED_LABEL: str(now)},
                                 running=False)
    mine = fake.add_container("mine", {LABEL: "1", OWNER_LABEL: owner_id(), CREATED_LABEL: str(now)})
    foreign_old = fake.add_container("foreign-old", {LABEL: "1", OWNER_LABEL: "otherhost:1:1",
                                                     CREATED_LABEL: str(now - 7200)})
    foreign_new = fake.add_container("foreign-new", {LABEL: "1", OWNER_LABEL: "otherhost:1:1",
                                                     CREATED_LABEL: str(now - 60)})
    unrelated = fake.add_container("unrelated", {"com.example": "x"})

    backend = _backend(fake, tmp_path / "home")  # reap_foreign_after_s=None: other hosts untouched
    assert sorted(backend.reaped) == sorted([leaked, stopped])
    assert set(fake.containers) == {mine, foreign_old, foreign_new, unrelated}

    backend2 = _backend(fake, tmp_path / "home", reap_foreign_after_s=3600)
    assert backend2.reaped == [foreign_old]
    assert set(fake.containers) == {mine, foreign_new, unrelated}
    assert _backend(fake, tmp_path / "home", reap=False).reaped == []
    # in the background (a task worker's choice): the backend is usable at once, the reap finishes on its own
    again = fake.add_container("leaked-again", {LABEL: "1", OWNER_LABEL: owner_id(dead.pid), CREATED_LABEL: str(now)})
    backend3 = _backend(fake, tmp_path / "home", reap="background")
    assert backend3.wait_reaped(30) and backend3.reaped == [again]
    assert set(fake.containers) == {mine, foreign_new, unrelated}
    with pytest.raises(ValueError, match="reap='later' must be true, false or 'background'"):
        _backend(fake, tmp_path / "home", reap="later")


def test_unreachable_daemon_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    with pytest.raises(SandboxUnavailableError, match="cannot reach a Docker daemon.*no-such.sock.*bwrap backend"):
        make_backend("docker", api_timeout_s=5)
    with pytest.raises(ValueError, match="unknown sandbox backend 'podman'"):
        make_backend("podman")
