"""Limits that hold for a whole bwrap sandbox: its cgroup (memory of all processes, CPU quota), size-capped
/tmp, /dev/shm and home, no process outliving its command, and no cgroup or mount outliving the sandbox."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from env_controller.sandbox import SandboxError, SandboxLimits, make_backend
from env_controller.sandbox import bwrap as bwrap_module
from env_controller.sandbox.bwrap import BwrapBackend, BwrapSandbox, find_bwrap
from env_controller.sandbox.cgroups import PREFIX, CgroupSystem, CgroupUnavailableError, owner_tag
from tests.env.support import _identity, _our_bwraps, wait_for_oom_kills

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed: apt-get install bubblewrap (CI installs it)")

try:
    CgroupSystem.detect()
    NO_CGROUPS = ""
except CgroupUnavailableError as exc:
    NO_CGROUPS = str(exc)
except ValueError as exc:  # pragma: no cover - the default parent is valid
    NO_CGROUPS = str(exc)
needs_cgroups = pytest.mark.skipif(bool(NO_CGROUPS), reason=f"sandbox cgroups cannot be made here: {NO_CGROUPS}")

LIMITS = SandboxLimits(timeout_s=5, max_processes=32, memory_mb=128, tmp_mb=8, max_file_mb=16)
# a process of 100 MB, after ``wait`` seconds
HOG = "python3 -c 'import time; time.sleep({wait}); b = bytearray(100 << 20); time.sleep(60)'"


def _cgroup_dirs(name: str) -> list[Path]:
    """Every directory of cgroup ``name`` under the parents of this machine's sandbox cgroups."""
    return [parent / name for parent in CgroupSystem.detect().parents if (parent / name).exists()]


def _our_mounts() -> list[str]:
    mine = f" {PREFIX}{owner_tag()}-"
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if mine in line]


@pytest.fixture
def backend() -> Iterator[BwrapBackend]:
    """A backend with a 16 MB home; after the test no process, cgroup or mount of its sandboxes is left."""
    b = make_backend("bwrap", LIMITS, home_mb=16)
    assert isinstance(b, BwrapBackend)
    yield b
    boxes = b.live()
    names = [box.cgroup.name for box in boxes if isinstance(box, BwrapSandbox) and box.cgroup is not None]
    b.close()
    assert _our_bwraps() == [] and _our_mounts() == [] and not b.base_dir.exists()
    assert [d for name in names for d in _cgroup_dirs(name)] == []


def _processes_running(box: BwrapSandbox, needle: bytes) -> list[int]:
    """Host pids of the sandbox (by its process tree) whose command line holds ``needle``."""
    out = []
    for pid in box.processes():
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


@needs_cgroups
def test_memory_counts_all_processes_together(backend: BwrapBackend) -> None:
    assert not any("cgroup" in w for w in backend.health()["warnings"]) and "memory" in backend.health()["cgroups"]
    with backend.create(replace(LIMITS, background_jobs=True)) as box:
        assert isinstance(box, BwrapSandbox) and box.cgroup is not None
        shell = box.cgroup.procs()
        assert len(shell) == 3 and shell == set(box.processes())  # bwrap, its init, bash: all in the cgroup
        # four 100 MB processes under a 128 MB limit for the sandbox: stopped during the command
        r = box.run(" ".join([HOG.format(wait=0) + " &"] * 4) + " sleep 3; echo survived")
        assert r.limit == "memory_limit" and r.restarted, r
        assert r.error.startswith("the command was killed because the sandbox's memory limit of 128 MB was reached")
        peak = box.cgroup.memory_peak_bytes()
        assert peak is not None and peak <= 128 << 20
        assert box.cgroup.procs() != shell and len(box.cgroup.procs()) == 3  # a fresh shell, nothing else
        assert _processes_running(box, b"bytearray") == []
        # ... or in the background after it returned: the next command says so
        kills = box.cgroup.oom_kills() or 0
        r = box.run(" ".join([HOG.format(wait=1) + " &"] * 4) + " echo started")
        assert r.ok and r.output == "started\n", r
        seen = {_identity(p) for p in box.processes()} - {None}
        wait_for_oom_kills(box.cgroup, kills + 2)
        r = box.run("echo next")
        assert r.ok and r.output.startswith("[note: background processes had reached the sandbox's memory limit "
                                            "of 128 MB and were killed; a new shell was started"), r
        assert r.output.endswith("next\n") and _processes_running(box, b"bytearray") == []
        assert all(_identity(pid) != (pid, start) for pid, start in seen)  # checked from the host
        usage = box.cgroup.memory_bytes()
        assert usage is not None and usage < 64 << 20
        name = box.cgroup.name
    assert _cgroup_dirs(name) == []


def test_tmp_and_shm_are_capped(backend: BwrapBackend) -> None:
    with backend.create() as box:
        r = box.run("df -m /tmp /dev/shm | tail -n 2 | awk '{print $2}'; touch /dev/evil")
        assert r.output.split()[:2] == ["8", "8"] and "Read-only file system" in r.output, r
        for where in ("/tmp", "/dev/shm"):
            r = box.run(f"head -c 6M /dev/zero > {where}/a; head -c 6M /dev/zero > {where}/b; echo after")
            assert r.limit == "disk_full" and not r.restarted and r.output.endswith("after\n"), r
            assert "No space left on device" in r.output
            assert r.error == (f"{where} is full (its size limit is 8 MB), so a write failed; "
                               "delete files there to make room")
            r = box.run(f"rm {where}/b; head -c 1M /dev/zero > {where}/c && echo room")
            assert r.ok and r.output == "room\n"


def test_home_is_capped(backend: BwrapBackend) -> None:
    if backend.mount_problem is not None:
        pytest.skip(f"the home cannot be capped here: {backend.mount_problem}")
    with backend.create() as box:
        r = box.run("for i in 1 2 3; do head -c 7M /dev/zero > f$i; done; du -sm ~ | cut -f1")
        assert r.limit == "disk_full" and int(r.output.split()[-1]) <= 16, r
        assert r.error.startswith("/home/user is full (its size limit is 16 MB)")
        with pytest.raises(SandboxError, match="No space left"):
            box.copy_in({"more.bin": b"x" * (4 << 20)})
        # the cap holds across shell restarts, and so do the files
        assert box.run("exit 1").restarted
        assert box.run("ls ~").output.split()[:3] == ["f1", "f2", "f3"]


def test_a_bwrap_without_size_gets_host_mounted_tmpfs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap_module, "supports_size", lambda bwrap: False)  # as bubblewrap before 0.7
    with make_backend("bwrap", LIMITS) as backend:
        assert isinstance(backend, BwrapBackend) and not backend.tmpfs_size
        if backend.mount_problem is not None:
            assert any("/tmp and /dev/shm are not capped" in w for w in backend.health()["warnings"])
            pytest.skip(f"tmpfs cannot be mounted here: {backend.mount_problem}")
        with backend.create() as box:
            r = box.run("df -m /tmp /dev/shm | tail -n 2 | awk '{print $2}'; head -c 9M /dev/zero > /tmp/a")
            assert r.output.split()[:2] == ["8", "8"] and r.limit == "disk_full", r
    assert _our_mounts() == []


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "process-tree"])
def test_background_processes_end_with_their_command(cgroups: bool) -> None:
    if cgroups and NO_CGROUPS:
        pytest.skip(f"sandbox cgroups cannot be made here: {NO_CGROUPS}")
    backend = make_backend("bwrap", LIMITS, cgroups=cgroups)
    assert isinstance(backend, BwrapBackend) and (backend.cgroups is not None) == cgroups
    try:
        with backend.create() as box:
            assert isinstance(box, BwrapSandbox)
            shell = set(box.processes())
            r = box.run("(while :; do :; done) & setsid sleep 100 & disown; echo started")
            assert r.ok and r.output.startswith("started\n[note: 2 processes left running in the background "
                                                "stopped when the command returned"), r
            # from the host: nothing but the idle shell is left, in the cgroup or in the process tree
            assert set(box.processes()) == shell
            if box.cgroup is not None:
                assert box.cgroup.procs() == shell
            assert box.run("echo quiet").output == "quiet\n"  # no "Killed" line of bash's for the jobs
    finally:
        backend.close()
    assert _our_bwraps() == []


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "process-tree"])
def test_a_pid_reused_by_a_host_process_is_never_signalled(cgroups: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The straggler scan names a pid whose process ended and whose number went to a process outside the sandbox
    (pids wrap at kernel.pid_max, 32768 here): the sandbox's own stray is killed, the host process lives."""
    if cgroups and NO_CGROUPS:
        pytest.skip(f"sandbox cgroups cannot be made here: {NO_CGROUPS}")
    backend = make_backend("bwrap", LIMITS, cgroups=cgroups)
    host = subprocess.Popen(["sleep", "60"])
    try:
        with backend.create() as box:
            assert isinstance(box, BwrapSandbox)
            scan = box._sandbox_pids
            monkeypatch.setattr(box, "_sandbox_pids", lambda: scan() | {host.pid})
            r = box.run("sleep 100 & echo started")
            assert r.ok and r.output.startswith("started\n[note: 1 process left running in the background "), r
            monkeypatch.undo()
            assert host.poll() is None  # not signalled
            assert {p for p in box.processes() if bwrap_module._alive(p)} == box._shell_pids
    finally:
        host.kill()
        host.wait()
        backend.close()
    assert _our_bwraps() == []


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup", "process-tree"])
def test_a_killed_sandbox_waits_for_its_own_processes_only(cgroups: bool, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The kill of a sandbox waits for the processes it scanned to exit; a scanned pid already reused by a host
    process is neither signalled nor waited for (no false 10 s wait, no "survived" error)."""
    if cgroups and NO_CGROUPS:
        pytest.skip(f"sandbox cgroups cannot be made here: {NO_CGROUPS}")
    backend = make_backend("bwrap", LIMITS, cgroups=cgroups)
    host = subprocess.Popen(["sleep", "60"])
    try:
        box = backend.create(replace(LIMITS, background_jobs=True))
        assert isinstance(box, BwrapSandbox)
        assert box.run("sleep 100 & echo started").output == "started\n"
        inside = set(box.processes())
        scan = bwrap_module.descendants
        monkeypatch.setattr(bwrap_module, "descendants", lambda pid: scan(pid) + [host.pid])
        started = time.monotonic()
        with caplog.at_level("ERROR", logger=bwrap_module.__name__):
            box.close()
        took = time.monotonic() - started
        monkeypatch.undo()
        assert host.poll() is None  # not signalled
        assert took < 5 and not caplog.records, (took, caplog.records)
        assert not any(bwrap_module._alive(p) for p in inside)
    finally:
        host.kill()
        host.wait()
        backend.close()
    assert _our_bwraps() == []


def test_a_stray_the_process_tree_missed_is_still_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cgroup the strays are found in the host's process tree, which misses a process whose parent
    exited while the tree was read; the sandbox's own /proc, counted after an empty scan, does not."""
    backend = make_backend("bwrap", LIMITS, cgroups=False)
    try:
        with backend.create() as box:
            assert isinstance(box, BwrapSandbox)
            shell = set(box.processes())
            scan, missed = box._sandbox_pids, []

            def first_scan_misses_the_command() -> set[int]:
                if not missed:
                    missed.append(scan() - box._shell_pids)
                    return set(box._shell_pids)
                return scan()

            monkeypatch.setattr(box, "_sandbox_pids", first_scan_misses_the_command)
            r = box.run("sleep 100 & echo started")
            monkeypatch.undo()
            assert missed and missed[0], "the command's sleep was not running at the first scan"
            assert r.ok and r.output.startswith("started\n[note: 1 process left running in the background "), r
            assert set(box.processes()) == shell
    finally:
        backend.close()
    assert _our_bwraps() == []


@needs_cgroups
def test_cpu_quota_holds_for_the_sandbox() -> None:
    backend = make_backend("bwrap", SandboxLimits(timeout_s=10, cpus=0.2))
    try:
        with backend.create() as box:
            # two busy loops for 1.5 s of wall time share 0.2 CPUs: about 0.3 s of CPU time in all
            r = box.run("for i in 1 2; do timeout 1.5 bash -c 'while :; do :; done' & done; wait; times")
            user, system = r.output.split("\n")[1].split()
            cpu = sum(float(t.split("m")[0]) * 60 + float(t.split("m")[1].rstrip("s")) for t in (user, system))
            assert 0.1 < cpu < 0.6, r.output
    finally:
        backend.close()


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"limits.cpus=0 must be a number of CPUs of at least 0.01"):
        SandboxLimits(cpus=0)
    with pytest.raises(ValueError, match="limits.background_jobs='yes' must be true or false"):
        SandboxLimits(background_jobs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="home_mb=0 must be a positive integer"):
        make_backend("bwrap", home_mb=0)


def test_without_cgroups_it_says_so_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(bwrap_module, "_warned", set())
    caplog.set_level(logging.WARNING, logger="env_controller.sandbox.bwrap")
    backends = [make_backend("bwrap", LIMITS, cgroups=False) for _ in range(2)]
    try:
        health = backends[0].health()
        assert health["cgroups"] is None and health["warnings"][0].startswith(
            "no cgroup per sandbox (turned off (cgroups=False)): memory_mb caps each process's address space")
        said = [rec.getMessage() for rec in caplog.records if "no cgroup per sandbox" in rec.getMessage()]
        assert len(said) == 1, said
        with backends[0].create() as box:  # the per-process limits still hold
            r = box.run("python3 -c 'b = bytearray(1 << 30)'")
            assert r.exit_code == 1 and "MemoryError" in r.output
    finally:
        for b in backends:
            b.close()


_CRASH = textwrap.dedent("""
    import os
    from env_controller.sandbox import SandboxLimits, make_backend
    box = make_backend("bwrap", SandboxLimits(), home_mb=8).create()
    box.run("echo data > ~/kept")
    print(box.cgroup.name if box.cgroup else "", box.host_home, flush=True)
    os.kill(os.getpid(), 9)
""")


@needs_cgroups
def test_leaked_cgroups_and_mounts_are_removed_at_start() -> None:
    # a worker that dies without closing anything leaves its sandbox's cgroup and home mount behind
    crashed = subprocess.run([sys.executable, "-c", _CRASH], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[2])
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    name, home = crashed.stdout.split()
    assert _cgroup_dirs(name) != []
    mounted = any(f" {home} " in line for line in Path("/proc/self/mountinfo").read_text().splitlines())
    # ... as would a sandbox cgroup of another dead owner (our pid, with a start time it never had)
    fake = f"{PREFIX}{owner_tag().rsplit('-', 1)[0]}-0-bwrap-dead-1"
    for parent in CgroupSystem.detect().parents:
        (parent / fake).mkdir()
    backend = make_backend("bwrap", LIMITS)
    try:
        assert isinstance(backend, BwrapBackend)
        assert name in backend.reaped and fake in backend.reaped
        assert _cgroup_dirs(name) == [] and _cgroup_dirs(fake) == []
        assert mounted or backend.mount_problem is not None
        if mounted:
            assert not Path(home).exists()
            assert all(f" {home} " not in line for line in Path("/proc/self/mountinfo").read_text().splitlines())
        # the cgroups of live owners stay
        with backend.create() as box, make_backend("bwrap", LIMITS) as second:
            assert isinstance(box, BwrapSandbox) and box.cgroup is not None
            assert second.reaped == [] and _cgroup_dirs(box.cgroup.name) != []
            name = box.cgroup.name
        assert _cgroup_dirs(name) == []
    finally:
        backend.close()
