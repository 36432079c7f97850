"""The docker sandbox backend on a real Docker engine (a private dockerd started by the tests): the shell,
limits enforced by the engine and reported in one sentence, isolation, background jobs, and the reaping
of containers whose owner was killed. Skips only where dockerd cannot run."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.env.support import (
    loopback_listener,
    run_background_bomb,
    run_floods,
    run_foreground_bomb,
    run_never_ending,
    wait_for_oom_kills,
)

docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")

from env_controller.sandbox import SandboxError, SandboxLimits  # noqa: E402
from env_controller.sandbox import docker as docker_module  # noqa: E402
from env_controller.sandbox.docker import LABEL, OWNER_LABEL, DockerBackend, DockerSandbox, owner_id  # noqa: E402
from env_controller.sandbox.options import DockerOptions  # noqa: E402

LIMITS = SandboxLimits(timeout_s=5, max_processes=32, max_output_bytes=8192, memory_mb=128, tmp_mb=8,
                       max_file_mb=4)
# a process holding 100 MB (tail keeps the last 100 MB of a pipe that stays open), after ``wait`` seconds
HOG = "{{ sleep {wait}; head -c 100M /dev/zero; sleep 60; }} | tail -c 100M"
RESET = "a new shell was started: the working directory and variables are reset, files are kept"


@pytest.fixture(scope="module")
def backend(docker_engine: Any, os_shell_image: str) -> Iterator[DockerBackend]:
    """One backend for the module; no container of this process is left after it."""
    b = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url, home_mb=16))
    yield b
    b.close()
    assert _containers(docker_engine, owner_id()) == []


def _containers(engine: Any, owner: str | None = None) -> list[dict[str, Any]]:
    """Sandbox containers of the engine (``docker ps -a --filter label=org.agentrl.sandbox=1``), of ``owner``, as the
    rows of one list call (docker-py's ``containers.list`` inspects each one after listing: a container removed
    meanwhile fails it)."""
    client = engine.client()
    try:
        found = client.api.containers(all=True, filters={"label": f"{LABEL}=1"})
    finally:
        client.close()
    return [c for c in found if owner is None or (c["Labels"] or {}).get(OWNER_LABEL) == owner]


def _processes(box: DockerSandbox) -> list[str]:
    """The command lines of the container's processes, from the host (``docker top``)."""
    top = box.container.top()
    column = top["Titles"].index("CMD")
    return [row[column] for row in top["Processes"]]


def _idle(box: DockerSandbox) -> bool:
    """Only init, ``sleep infinity`` and the idle shell run in the container."""
    procs = _processes(box)
    return len(procs) == 3 and "sleep infinity" in procs and "bash --noprofile --norc" in procs


def _cpu_seconds(times_output: str) -> float:
    """User plus system time of the children, from the second line of bash's ``times``."""
    user, system = times_output.split("\n")[1].split()
    return sum(float(t.split("m")[0]) * 60 + float(t.split("m")[1].rstrip("s")) for t in (user, system))


def test_shell_files_reset_and_close(backend: DockerBackend, docker_engine: Any) -> None:
    started = time.monotonic()
    box = backend.create(labels={"purpose": "test"})
    took = time.monotonic() - started
    print(f"\ncontainer and shell ready in {took:.2f} s")
    assert isinstance(box, DockerSandbox) and took < 10
    health = backend.health()
    assert health["counting"] == "host" and health["sandboxes"] == 1 and "cgroup" in health["engine"], health
    assert box.container.labels["purpose"] == "test" and box.container.labels[OWNER_LABEL] == owner_id()
    r = box.run("id; hostname; pwd")
    assert r.ok and r.output == "uid=1000(user) gid=1000(user) groups=1000(user)\nsandbox\n/home/user\n", r
    box.copy_in({"notes/a.txt": "first\nsecond\n", "/tmp/t/b.bin": b"x\x01\xffy"})
    box.copy_in({"/home/user/run.sh": "echo ran\n"}, mode=0o755)
    assert box.run("cd notes && export COLOR=blue").ok
    r = box.run("pwd; echo $COLOR; wc -l < a.txt; ../run.sh; od -An -tx1 /tmp/t/b.bin")
    assert r.output == "/home/user/notes\nblue\n2\nran\n 78 01 ff 79\n", r
    started = time.monotonic()
    r = box.run("echo out; echo err >&2; (exit 5)")
    print(f"a command's round trip: {time.monotonic() - started:.3f} s")
    assert r.output == "out\nerr\n" and r.exit_code == 5 and r.limit is None
    assert box.run("cat").output == ""  # stdin is /dev/null
    with pytest.raises(ValueError, match="outside the writable"):
        box.copy_in({"/etc/evil": "x"})
    r = box.run("exit 3")
    assert r.limit == "shell_exited" and r.restarted and RESET in r.error
    assert box.run("pwd; echo ${COLOR:-none}; head -1 notes/a.txt").output == "/home/user\nnone\nfirst\n"
    box.run("cd /tmp; export COLOR=red")
    box.reset()
    assert box.run("pwd; echo ${COLOR:-none}; ls /tmp").output == "/home/user\nnone\nt\n"
    assert _idle(box)
    box.close()
    client = docker_engine.client()
    try:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(box.container.id)
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.run("true")
    assert backend.live() == []
    with pytest.raises(ValueError, match="cannot run as root"):
        DockerBackend(None, DockerOptions(image="x", user="0:0", reap=False), client=backend.client)


def test_isolation(backend: DockerBackend) -> None:
    listener, port = loopback_listener()
    secrets = [tempfile.NamedTemporaryFile(prefix="agentrl-host-secret-", dir=d) for d in ("/tmp", "/root")
               if os.access(d, os.W_OK)]
    a, b = backend.create(), backend.create()
    try:
        # network_mode none: loopback only, nothing outside (not the host's loopback either) is reached
        r = a.run("tail -n +3 /proc/net/dev | cut -d: -f1; exec 3<>/dev/tcp/1.1.1.1/53")
        assert r.output.split()[0] == "lo" and "Network is unreachable" in r.output and r.exit_code != 0, r
        r = a.run(f"exec 3<>/dev/tcp/127.0.0.1/{port}")
        assert r.exit_code != 0 and "Connection refused" in r.output, r
        with pytest.raises(socket.timeout):
            listener.accept()
        # read-only root, cgroup files included (no raising its own limits)
        for path in ("/usr/bin/evil", "/etc/passwd", "/evil", "/home/evil", "/proc/sys/kernel/hostname",
                     "/sys/fs/cgroup/pids/pids.max"):
            r = a.run(f"echo x > {path}")
            assert r.exit_code != 0 and ("Read-only file system" in r.output or "Permission denied" in r.output), r
        # no capabilities, no new privileges, a seccomp filter
        r = a.run("grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
        assert r.output.split() == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000",
                                    "NoNewPrivs:", "1", "Seccomp:", "2"], r
        # host files and the other sandbox are out of sight
        for secret in secrets:
            r = a.run(f"test -e {secret.name} && echo visible || echo hidden")
            assert r.output == "hidden\n", (secret.name, r)
        a.run("echo mine > /tmp/private-a; echo a > ~/only-a")
        assert not Path("/tmp/private-a").exists()
        assert b.run("ls -A /tmp; ls -A ~; ls /home").output == "user\n"
    finally:
        a.close()
        b.close()
        listener.close()
        for secret in secrets:
            secret.close()


def test_wall_time_output_and_file_size(backend: DockerBackend) -> None:
    with backend.create() as box:
        for script, r, elapsed in run_never_ending(box):
            assert r.error == f"the command ran past the 1 s time limit and was killed; {RESET}" and elapsed < 4
            assert _idle(box), (script, _processes(box))
        run_floods(box)
        r = box.run("head -c 10M /dev/zero > big; stat -c %s big")
        assert "File size limit exceeded" in r.output and r.output.split()[-1] == str(4 << 20), r


def test_tmp_and_home_are_capped(backend: DockerBackend) -> None:
    with backend.create() as box:
        r = box.run("df -m /tmp ~ | tail -n 2 | awk '{print $2}'")
        assert r.output.split() == ["8", "16"], r
        r = box.run("for f in a b c; do head -c 3M /dev/zero > /tmp/$f; done; echo after")
        assert r.limit == "disk_full" and not r.restarted and r.output.endswith("after\n"), r
        assert r.error == "/tmp is full (its size limit is 8 MB), so a write failed; delete files there to make room"
        r = box.run("rm /tmp/c; head -c 1M /dev/zero > /tmp/d && echo room")
        assert r.ok and r.output == "room\n"
        r = box.run("for i in 1 2 3 4 5 6; do head -c 3M /dev/zero > f$i; done; du -sm ~ | cut -f1")
        assert r.limit == "disk_full" and int(r.output.split()[-1]) <= 16, r
        assert r.error.startswith("/home/user is full (its size limit is 16 MB)")
        with pytest.raises(SandboxError, match="writing /home/user/more.bin failed: /home/user is full"):
            box.copy_in({"more.bin": b"x" * (1 << 20)})
        assert box.run("exit 1").restarted  # files outlive the shell
        assert box.run("ls ~").output.split()[:3] == ["f1", "f2", "f3"]


def test_memory_counts_all_processes_together(backend: DockerBackend) -> None:
    with backend.create(replace(LIMITS, background_jobs=True)) as box:
        assert box.cgroup is not None
        # four 100 MB processes under a 128 MB limit for the container: stopped during the command
        r = box.run(" ".join([HOG.format(wait=0) + " &"] * 4) + " sleep 3; echo survived")
        assert r.limit == "memory_limit" and r.restarted, r
        assert r.error == ("the command was killed because the sandbox's memory limit of 128 MB was reached (its "
                           f"processes and in-memory files count together); all its processes were killed; {RESET}")
        peak = box.cgroup.memory_peak_bytes()
        print(f"\nmemory peak of the container: {peak and peak / 2**20:.1f} MB (limit 128 MB)")
        # the kernel charges a cgroup in per-CPU batches (64 pages) before it reclaims or kills, so the
        # recorded peak may pass memory.max by a few pages; four hogs unchecked would reach 400 MB
        assert peak is not None and peak <= (128 << 20) + (1 << 20)
        assert _idle(box), _processes(box)
        # ... or in the background after the command returned: the next command says so
        kills = box.cgroup.oom_kills() or 0
        r = box.run(" ".join([HOG.format(wait=0.5) + " &"] * 4) + " echo started")
        assert r.ok and r.output == "started\n", r
        wait_for_oom_kills(box.cgroup, kills + 1)
        r = box.run("echo next")
        assert r.ok and r.output.startswith("[note: background processes had reached the sandbox's memory limit "
                                            f"of 128 MB and were killed; {RESET}]"), r
        assert r.output.endswith("next\n") and _idle(box)
        usage = box.cgroup.memory_bytes()
        assert usage is not None and usage < 64 << 20


def test_fork_bombs_are_stopped(backend: DockerBackend) -> None:
    # background jobs allowed, so that a bomb can outlive its command
    with backend.create(replace(LIMITS, background_jobs=True)) as box:
        r, started = run_foreground_bomb(box)
        assert r.error.startswith("the command reached the limit of 32 processes (a fork bomb?)")
        assert time.monotonic() - started < 3
        # the forks the container's cgroup refused, which a bomb settled below the count's threshold still shows
        hits = box._process_limit_hits()
        assert hits is not None and hits > 0 and box.run("true").limit is None
        run_background_bomb(box)
        r = box.run("pwd; echo ${KEEP:-reset}")
        assert r.ok and r.output == "/home/user\nreset\n" and _idle(box)
        assert time.monotonic() - started < 10
    # without background jobs a bomb ends with its command
    with backend.create() as box:
        r = box.run("bomb() { bomb | bomb & }; bomb; echo back")
        assert r.limit in (None, "process_limit"), r
        assert _idle(box), _processes(box)


def test_cpu_quota_holds_for_the_container(backend: DockerBackend) -> None:
    # two busy loops for 1.5 s of wall time: about 0.3 s of CPU time in all under 0.2 CPUs; under 2, what the
    # machine gives (3 s on two free cores; one shared core gives 1.5 s)
    script = "for i in 1 2; do timeout 1.5 bash -c 'while :; do :; done' & done; wait; times"
    cpu = {}
    for cpus in (0.2, 2.0):
        with backend.create(replace(LIMITS, cpus=cpus)) as box:
            assert box.container.attrs["HostConfig"]["NanoCpus"] == round(min(cpus, os.cpu_count() or 1) * 1e9)
            cpu[cpus] = _cpu_seconds(box.run(script).output)
    print(f"\nCPU time of two 1.5 s busy loops: {cpu[0.2]:.2f} s under cpus=0.2, {cpu[2.0]:.2f} s under cpus=2")
    assert 0.1 < cpu[0.2] < 0.6 and cpu[2.0] > 3 * cpu[0.2], cpu
    ncpu = backend.info["NCPU"]
    with backend.create(replace(LIMITS, cpus=ncpu + 1)) as box:
        assert box.container.attrs["HostConfig"]["NanoCpus"] == ncpu * 10**9
    assert any(f"more than the engine's {ncpu} CPUs" in w for w in backend.health()["warnings"])


def test_background_jobs(backend: DockerBackend) -> None:
    with backend.create() as box:  # background_jobs=False: nothing outlives its command
        r = box.run("(while :; do :; done) & (sleep 100 &); sleep 100 & echo started")
        assert r.ok and r.output.startswith("started\n[note: 3 processes left running in the background stopped "
                                            "when the command returned"), r
        assert _idle(box), _processes(box)  # seen from the host
        assert box.run("echo quiet").output == "quiet\n"  # no "Killed" line of bash's for the jobs
    with backend.create(replace(LIMITS, background_jobs=True)) as box:
        r = box.run("cd /tmp; sleep 100 & (sleep 200 &); echo started")
        assert r.ok and r.output == "started\n", r
        assert sorted(p for p in _processes(box) if p.startswith("sleep 1") or p.startswith("sleep 2")) == [
            "sleep 100", "sleep 200"]
        assert box.run("pwd").output == "/tmp\n"
        # they count against the processes of the sandbox
        r = box.run("for i in $(seq 30); do sleep 100 & done; echo done")
        assert r.limit == "process_limit" and r.restarted, r
        assert _idle(box), _processes(box)


def test_background_jobs_end_when_the_runtime_fails_to_start_the_kill(backend: DockerBackend,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # at its process limit (a fork bomb) a container's runtime may fail to start an exec; the engine answers
    # with the runtime's error as the exec's output. The kill that ends what a command left is such an exec.
    with backend.create() as box:
        api = backend.client.api
        start = api.exec_start
        refused: list[str] = []

        def exec_start(exec_id: str, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("socket") and len(refused) < 2:  # the shell's own exec attaches a socket
                refused.append(exec_id)
                return (b"OCI runtime exec failed: exec failed: unable to start container process: read init-p: "
                        b"connection reset by peer: unknown\r\n")
            return start(exec_id, *args, **kwargs)

        monkeypatch.setattr(api, "exec_start", exec_start)
        r = box.run("sleep 100 & sleep 100 & echo started")
        assert len(refused) == 2
        assert r.ok and r.output.startswith("started\n[note: 2 processes left running in the background stopped"), r
        assert _idle(box), _processes(box)


def test_counting_through_exec_without_host_cgroups(backend: DockerBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    # as with a remote engine: the container's cgroup is read from inside, by an exec
    monkeypatch.setattr(docker_module, "container_cgroup", lambda pid, cid: None)
    with backend.create() as box:
        assert box.cgroup is None and backend.health()["counting"] == "exec"
        assert any("not visible from this process" in w for w in backend.health()["warnings"])
        assert box.run("echo plain").output == "plain\n"
        r = box.run("sleep 100 & echo started")
        assert r.output.startswith("started\n[note: 1 process left running in the background stopped"), r
        assert _idle(box)
        r = box.run("f() { f | f; }; f")
        assert r.limit == "process_limit", r
        hits = box._process_limit_hits()  # read from inside too
        assert hits is not None and hits > 0 and box.run("true").limit is None
        r = box.run(" ".join([HOG.format(wait=0) + " &"] * 2) + " sleep 2; echo survived")
        assert r.limit == "memory_limit", r
        assert _idle(box)
    monkeypatch.undo()
    with backend.create():
        assert backend.health()["counting"] == "host"


_CRASH = textwrap.dedent("""
    import os, sys
    from env_controller.sandbox.docker import DockerBackend
    from env_controller.sandbox.options import DockerOptions
    backend = DockerBackend(None, DockerOptions(image=sys.argv[2], docker_host=sys.argv[1]))
    boxes = [backend.create() for _ in range(2)]
    boxes[0].run("echo data > ~/kept")
    print(" ".join(box.container.id for box in boxes), flush=True)
    os.kill(os.getpid(), 9)
""")


def test_leaked_containers_are_reaped_after_kill_9(docker_engine: Any, os_shell_image: str) -> None:
    crashed = subprocess.run([sys.executable, "-c", _CRASH, docker_engine.url, os_shell_image], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    ids = crashed.stdout.split()
    assert len(ids) == 2 and {c["Id"] for c in _containers(docker_engine)} >= set(ids)
    b = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url))
    try:
        assert sorted(b.reaped) == sorted(ids)
        assert _containers(docker_engine) == []
        if shutil.which("docker"):  # the same question through the docker CLI
            ps = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}=1"], capture_output=True,
                                text=True, timeout=30, env={**os.environ, "DOCKER_HOST": docker_engine.url})
            assert ps.returncode == 0 and ps.stdout.strip() == "", ps
        # the containers of a live owner stay
        with b.create():
            second = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url))
            assert second.reaped == [] and len(_containers(docker_engine)) == 1
            second.close()
    finally:
        b.close()
    assert _containers(docker_engine) == []


def test_a_built_in_image_is_roots_but_the_users_home_whoever_built_it(docker_engine: Any, tmp_path: Path) -> None:
    """A worker that is not root builds the image from files it owns: they must not reach the image as the
    sandbox user's (uid 1000 here, the builder's too), or the agent could replace /usr/bin's tools and /etc."""
    from env_controller.sandbox.docker_image import USER_ID, _tar, build_rootfs

    root = tmp_path / "rootfs"
    build_rootfs(root, ("bash", "stat", "cmp"))
    for path in [root, *root.rglob("*")]:  # as a builder of the sandbox user's uid leaves them
        os.lchown(path, USER_ID, USER_ID)
    data, digest = _tar(root)
    client = docker_engine.client()
    tag = f"agentrl-test/owners:{digest[:12]}"
    try:
        client.api.import_image_from_data(data, repository=tag.split(":")[0], tag=tag.split(":")[1])
        out = client.containers.run(tag, ["stat", "-c", "%u:%g %n", "/usr/bin/cmp", "/etc", "/etc/passwd", "/usr/bin",
                                          "/home/user"], remove=True, network_disabled=True).decode()
    finally:
        client.images.remove(tag, force=True)
        client.close()
    assert out.splitlines() == ["0:0 /usr/bin/cmp", "0:0 /etc", "0:0 /etc/passwd", "0:0 /usr/bin",
                                f"{USER_ID}:{USER_ID} /home/user"], out


def test_a_reused_writable_root_container_keeps_no_ipc_object(docker_engine: Any, tmp_path: Path) -> None:
    """System V IPC objects live in the container's IPC namespace, past every process and file: a session's
    shared memory, semaphores and queues are removed by the wipe, so the next session in the container sees none
    (an image without ``ipcrm`` is clean only when none was made: one of it with an object is not reused)."""
    from env_controller.sandbox.docker_image import DEFAULT_TOOLS, _tar, build_rootfs

    client = docker_engine.client()
    tags = []
    try:
        for tools in ((*DEFAULT_TOOLS, "ipcmk", "ipcrm"), (*DEFAULT_TOOLS, "ipcmk")):
            root = tmp_path / f"rootfs{len(tags)}"
            build_rootfs(root, tools)
            data, digest = _tar(root)
            tags.append(f"agentrl-test/ipc:{digest[:12]}")
            client.api.import_image_from_data(data, repository="agentrl-test/ipc", tag=digest[:12])
        with_ipcrm = DockerBackend(LIMITS, DockerOptions(image=tags[0], docker_host=docker_engine.url,
                                                         writable_root=True))
        try:
            with with_ipcrm.create() as box:
                made = box.run("ipcmk -M 4096; ipcmk -S 2; ipcmk -Q; cat /proc/sysvipc/shm /proc/sysvipc/sem "
                               "/proc/sysvipc/msg | wc -l")
                assert made.ok and made.output.endswith("6\n"), made  # three headers, three objects
                box.wipe()
                assert box.run("cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg | wc -l").output == "3\n"
        finally:
            with_ipcrm.close()
        without = DockerBackend(LIMITS, DockerOptions(image=tags[1], docker_host=docker_engine.url,
                                                      writable_root=True))
        try:
            with without.create() as box:
                box.wipe()  # nothing made: reusable
                assert box.run("ipcmk -M 4096").ok
                with pytest.raises(SandboxError, match="the wipe left something behind"):
                    box.wipe()
        finally:
            without.close()
    finally:
        for tag in tags:
            client.images.remove(tag, force=True)
        client.close()


def test_a_container_over_its_disk_cap_is_stopped_where_the_engine_has_no_quota(docker_engine: Any,
                                                                               os_shell_image: str) -> None:
    """``disk_mb`` caps a writable root's own files. This engine's overlay2 is not on xfs with pquota, so it has no
    quota: the backend says so once and reads the layer's size itself. A command that leaves the files over the
    cap gets ``disk_full`` naming it; a command that keeps writing is stopped; once files are deleted, commands
    run again."""
    b = DockerBackend(LIMITS, DockerOptions(image=os_shell_image, docker_host=docker_engine.url, writable_root=True,
                                            disk_mb=8))
    try:
        with b.create() as box:
            if b.quota:
                pytest.skip("this engine enforces a disk quota per container")
            assert any("no per-container quota" in w for w in b.health()["warnings"]), b.health()
            r = box.run("for i in 1 2 3; do head -c 3M /dev/zero > /var/tmp/f$i; done; echo wrote")
            assert r.limit == "disk_full" and "more than its limit of 8 MB" in (r.error or "") and "wrote" in r.output
            assert box.run("rm /var/tmp/f*; echo ok").ok
            r = box.run("i=0; while :; do head -c 1M /dev/zero > /var/tmp/g$i; i=$((i+1)); sleep 0.2; done",
                        timeout_s=30)
            assert r.limit == "disk_full" and r.restarted and r.duration_s < 10, r
            assert "the command was stopped" in (r.error or "")
            assert box.run("rm /var/tmp/g*; echo ok").ok
    finally:
        b.close()
    with pytest.raises(ValueError, match="disk_mb=8 needs writable_root"):
        DockerOptions(image=os_shell_image, docker_host=docker_engine.url, disk_mb=8)
