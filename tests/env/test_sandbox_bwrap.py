"""The bubblewrap sandbox, for real: persistence, isolation, and escape attempts that must fail cleanly."""
from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from env_controller.sandbox import SandboxError, SandboxLimits, make_backend
from env_controller.sandbox.bwrap import BwrapBackend, BwrapSandbox, find_bwrap
from tests.env.support import (
    _identity,
    _our_bwraps,
    loopback_listener,
    run_background_bomb,
    run_floods,
    run_foreground_bomb,
    run_never_ending,
)

pytestmark = pytest.mark.skipif(
    find_bwrap() is None, reason="bubblewrap is not installed: apt-get install bubblewrap (CI installs it)")

LIMITS = SandboxLimits(timeout_s=2, max_processes=32, max_output_bytes=8192, memory_mb=512, tmp_mb=8,
                       max_file_mb=4)




@pytest.fixture
def backend() -> Iterator[BwrapBackend]:
    """A backend whose every sandbox process must be gone after the test."""
    b = make_backend("bwrap", LIMITS)
    assert isinstance(b, BwrapBackend)
    seen: set[tuple[int, bytes]] = set()
    original_run = BwrapSandbox.run

    def tracking_run(self: BwrapSandbox, script: str, timeout_s: float | None = None):  # type: ignore[no-untyped-def]
        result = original_run(self, script, timeout_s)
        seen.update(filter(None, map(_identity, self.processes())))
        return result

    BwrapSandbox.run = tracking_run  # type: ignore[method-assign]
    try:
        yield b
    finally:
        BwrapSandbox.run = original_run  # type: ignore[method-assign]
        b.close()
        assert not b.base_dir.exists()
        assert _our_bwraps() == []
        leaked = [p for p, start in seen if _identity(p) == (p, start)]
        assert leaked == [], (
            f"sandbox processes survived close: {[(p, Path(f'/proc/{p}/status').read_text()[:200]) for p in leaked]}"
        )


def test_persistent_shell_files_and_exit_codes(backend: BwrapBackend) -> None:
    with backend.create() as box:
        r = box.run("id -un; hostname; pwd")
        assert r.ok and r.output == "user\nsandbox\n/home/user\n"
        box.copy_in({"notes/a.txt": "first\nsecond\n", "/tmp/t/b.bin": b"x\x01\xffy"})
        box.copy_in({"/home/user/run.sh": "echo ran\n"}, mode=0o755)
        assert box.run("cd notes && export COLOR=blue && shopt -s nullglob").ok
        r = box.run("pwd; echo $COLOR; wc -l < a.txt; ../run.sh; od -An -tx1 /tmp/t/b.bin")
        assert r.output == "/home/user/notes\nblue\n2\nran\n 78 01 ff 79\n"
        r = box.run("echo out; echo err >&2; (exit 5)")
        assert r.output == "out\nerr\n" and r.exit_code == 5 and r.limit is None and not r.ok
        assert box.run("printf 'caf\\xc3\\xa9 no-newline'").output == "café no-newline"
        assert box.run("cat").output == ""  # stdin is /dev/null, never the control stream
        r = box.run("if then")
        assert r.exit_code == 2 and "syntax error" in r.output
        with pytest.raises(ValueError, match="NUL"):
            box.run("echo a\0b")
        with pytest.raises(ValueError, match="outside the writable"):
            box.copy_in({"/etc/evil": "x"})
        with pytest.raises(ValueError, match="'..'"):
            box.copy_in({"../escape": "x"})
        # exit ends the shell; a new one starts in the home, files kept, variables gone
        r = box.run("exit 3")
        assert r.limit == "shell_exited" and r.restarted and "new shell" in r.error
        r = box.run("pwd; echo ${COLOR:-none}; cat notes/a.txt | head -1")
        assert r.output == "/home/user\nnone\nfirst\n"
    with pytest.raises(RuntimeError, match="closed"):
        box.run("true")


def test_network_is_unreachable(backend: BwrapBackend) -> None:
    listener, port = loopback_listener()
    try:
        with backend.create() as box:
            r = box.run(f"exec 3<>/dev/tcp/127.0.0.1/{port}")
            assert r.exit_code != 0 and "Connection refused" in r.output
            r = box.run("exec 3<>/dev/tcp/1.1.1.1/53")
            assert r.exit_code != 0 and "Network is unreachable" in r.output
            r = box.run("getent hosts example.com || echo no-dns; tail -n +3 /proc/net/dev | cut -d: -f1")
            assert r.output.split() == ["no-dns", "lo"]  # loopback is the only interface
            r = box.run("python3 -c 'import socket; socket.create_connection((\"10.0.0.1\", 80), timeout=1)'")
            assert r.exit_code == 1 and "Network is unreachable" in r.output
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing from inside the sandbox ever reached the host's loopback
    finally:
        listener.close()


def test_writes_outside_the_sandbox_fail(backend: BwrapBackend) -> None:
    secret = tempfile.NamedTemporaryFile(prefix="agentrl-host-secret-", dir="/tmp")
    try:
        a, b = backend.create(), backend.create()
        for path in ("/usr/bin/evil", "/etc/passwd", "/evil", "/home/evil", "/proc/sys/kernel/hostname"):
            r = a.run(f"echo x > {path}")
            assert r.exit_code != 0 and ("Read-only file system" in r.output or "Permission denied" in r.output), (
                path,
                r,
            )
        r = a.run("rm -rf /usr/share/doc 2>&1 | head -1; ls /usr/share/doc | wc -l")
        assert "Read-only file system" in r.output and int(r.output.split()[-1]) > 0
        r = a.run("cat /etc/shadow; ls /root /work /run 2>&1")
        assert "Permission denied" in r.output and "No such file or directory" in r.output
        # the host's /tmp and the other sandbox's home are out of sight; /tmp is private
        r = a.run(f"ls -A /tmp; test -e {secret.name} && echo visible || echo hidden; "
                  "echo mine > /tmp/private-a; echo a > ~/only-a")
        assert r.output == "hidden\n" and not Path("/tmp/private-a").exists()
        assert b.run("ls -A /tmp; ls -A ~; ls /home").output == "user\n"
        # a symlink planted in the home does not redirect a later copy_in onto the host
        before = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
        a.run("ln -s /etc/hostname ~/planted")
        with pytest.raises(SandboxError, match="planted"):
            a.copy_in({"planted": "pwned\n"})
        if before is not None:
            assert Path("/etc/hostname").read_bytes() == before
        # file size and /tmp size are capped
        r = a.run("head -c 10M /dev/zero > big; stat -c %s big")
        assert "File size limit exceeded" in r.output and r.output.split()[-1] == str(4 << 20)
        r = a.run("for i in 1 2 3; do head -c 3M /dev/zero > /tmp/f$i; done")
        assert "No space left on device" in r.output
        a.close()
        b.close()
    finally:
        secret.close()


def test_fork_bomb_is_stopped(backend: BwrapBackend) -> None:
    # background jobs allowed, so that a bomb can outlive its command (without, it ends with it)
    with backend.create(replace(LIMITS, background_jobs=True)) as box:
        r, started = run_foreground_bomb(box)
        assert "limit of 32 processes" in r.error and "fork bomb" in r.error
        box.run("cd /tmp")
        run_background_bomb(box)
        assert time.monotonic() - started < 8
        r = box.run("pwd; echo ${KEEP:-reset}; ps -e --no-headers | wc -l")
        assert r.ok and r.output.split()[:2] == ["/home/user", "reset"] and int(r.output.split()[2]) <= 4
        # many ordinary background jobs are fine below the limit
        r = box.run("for i in 1 2 3 4 5; do sleep 30 & done; echo started")
        assert r.ok and r.output == "started\n"


def test_commands_that_never_end_are_killed(backend: BwrapBackend) -> None:
    with backend.create() as box:
        for script, r, elapsed in run_never_ending(box):
            assert "1 s time limit" in r.error and elapsed < 5, (script, elapsed)
            assert box.run("ps -e --no-headers | wc -l").output.strip() in ("3", "4"), script
        r = box.run("sleep 2.5; echo slept", timeout_s=5)  # longer than the default 2 s
        assert r.ok and r.output == "slept\n"


def test_output_flood_is_cut(backend: BwrapBackend) -> None:
    with backend.create() as box:
        for r in run_floods(box):
            assert len(r.output.encode("utf-8", "surrogateescape")) <= 8192 * 3, r
        r = box.run("head -c 8000 /dev/zero | tr '\\0' a")
        assert r.ok and len(r.output) == 8000 and not r.truncated


def test_memory_limit(backend: BwrapBackend) -> None:
    with backend.create() as box:
        r = box.run("python3 -c 'b = bytearray(1 << 30)'")
        assert r.exit_code == 1 and "MemoryError" in r.output
        r = box.run("python3 -c 'b = bytearray(100 << 20); print(len(b))'")
        assert r.ok and r.output == f"{100 << 20}\n"


def test_parallel_sandboxes_are_isolated(backend: BwrapBackend) -> None:
    boxes = [backend.create() for _ in range(4)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            box = boxes[i]
            box.run(f"echo {i} > mine; export ME={i}")
            for _ in range(5):
                r = box.run("cat mine; echo $ME; ls ~ | wc -l; ps -e --no-headers | wc -l")
                # only this sandbox's init, shell and pipeline are visible
                assert r.output.split()[:3] == [str(i), str(i), "1"] and r.output.split()[3] in ("3", "4"), r
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(backend.live()) == 4
    backend.close()
    assert backend.live() == [] and all(b.closed for b in boxes)


def test_missing_binary_is_a_clear_error() -> None:
    from env_controller.sandbox import SandboxUnavailableError

    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        make_backend("bwrap", bwrap="/nonexistent/bwrap")
