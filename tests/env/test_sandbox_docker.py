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

import json
import os
import re
import secrets
import select
import shutil
import signal
import socketserver
import struct
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

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


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class FakeDockerDaemon:
    """A minimal dockerd: the endpoints the docker SDK calls for run/list/remove/exec."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="fakedocker-")
        self.socket_path = os.path.join(self.dir, "docker.sock")
        self.containers: dict[str, dict[str, Any]] = {}
        self.execs: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            rbufsize = 0  # no hidden buffering: an upgraded connection is read raw

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                daemon.handle(self, "GET")

            def do_POST(self) -> None:
                daemon.handle(self, "POST")

            def do_DELETE(self) -> None:
                daemon.handle(self, "DELETE")

        self.server = _Server(self.socket_path, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket_path}"

    def client(self) -> Any:
        return docker.DockerClient(base_url=self.base_url, version="1.43", timeout=20)

    # -- plumbing ---------------------------------------------------------------------------

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, body: Any = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        h.send_response(code)
        h.send_header("Content-Type", "application/json" if not isinstance(body, bytes) else "text/plain")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _body(h: BaseHTTPRequestHandler) -> Any:
        n = int(h.headers.get("Content-Length") or 0)
        data = b""
        while len(data) < n:
            chunk = h.rfile.read(n - len(data))
            if not chunk:
                break
            data += chunk
        return json.loads(data) if data else {}

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        path = re.sub(r"^/v1\.\d+", "", url.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._body(h) if method == "POST" else None
        with self.lock:
            self.log.append((method, path, body))
        m = re.fullmatch(r"/(containers|exec)/([^/]+)/?(\w*)", path)
        try:
            if path == "/_ping":
                return self._reply(h, 200, b"OK")
            if path == "/version":
                return self._reply(h, 200, {"ApiVersion": "1.43", "Version": "24.0.0-fake", "MinAPIVersion": "1.12"})
            if path == "/info":
                return self._reply(h, 200, {"ServerVersion": "24.0.0-fake", "NCPU": 2, "CgroupVersion": "2",
                                            "CgroupDriver": "fake", "MemoryLimit": True, "SwapLimit": True,
                                            "PidsLimit": True, "CpuCfsQuota": True})
            if method == "POST" and path == "/containers/create":
                return self._create(h, query, body)
            if method == "GET" and path == "/containers/json":
                return self._list(h, query)
            if m and m.group(1) == "containers":
                cid = self._find(m.group(2))
                if cid is None:
                    return self._reply(h, 404, {"message": f"No such container: {m.group(2)}"})
                action = m.group(3)
                if method == "POST" and action == "start":
                    self.containers[cid]["running"] = True
                    return self._reply(h, 204)
                if method == "GET" and action == "json":
                    return self._reply(h, 200, self._inspect(cid))
                if method == "DELETE" and action == "":
                    self._kill_all(cid)
                    del self.containers[cid]
                    return self._reply(h, 204)
                if method == "POST" and action == "exec":
                    if not self.containers[cid]["running"]:
                        return self._reply(h, 409, {"message": f"Container {cid} is not running"})
                    eid = secrets.token_hex(32)
                    self.execs[eid] = {"container": cid, "config": body, "exit_code": None, "running": False}
                    return self._reply(h, 201, {"Id": eid})
            if m and m.group(1) == "exec" and m.group(2) in self.execs:
                if method == "POST" and m.group(3) == "start":
                    return self._exec_start(h, m.group(2))
                if method == "GET" and m.group(3) == "json":
                    e = self.execs[m.group(2)]
                    return self._reply(h, 200, {"ID": m.group(2), "Running": e["running"], "ExitCode": e["exit_code"]})
            return self._reply(h, 404, {"message": f"fake docker: no route {method} {path}"})
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _find(self, ref: str) -> str | None:
        for cid, c in self.containers.items():
            if cid.startswith(ref) or c["name"] == ref:
                return cid
        return None

    # -- containers ---------------------------------------------------------------------------

    def add_container(self, name: str, labels: dict[str, str], running: bool = True) -> str:
        """Register a container directly (as if left over by an earlier run)."""
        cid = secrets.token_hex(32)
        self.containers[cid] = {"name": name, "config": {"Image": "fake", "Labels": labels, "HostConfig": {}},
                                "running": running, "procs": [], "created": int(time.time())}
        return cid

    def _create(self, h: BaseHTTPRequestHandler, query: dict[str, str], body: Any) -> None:
        name = query.get("name") or secrets.token_hex(6)
        if any(c["name"] == name for c in self.containers.values()):
            return self._reply(h, 409, {"message": f"Conflict. The container name {name!r} is already in use"})
        cid = secrets.token_hex(32)
        self.containers[cid] = {
            "name": name,
            "config": body,
            "running": False,
            "procs": [],
            "created": int(time.time()),
        }
        self._reply(h, 201, {"Id": cid, "Warnings": []})

    def _inspect(self, cid: str) -> dict[str, Any]:
        c = self.containers[cid]
        status = "running" if c["running"] else "created"
        return {"Id": cid, "Name": "/" + c["name"], "Created": str(c["created"]),
                "Config": {**c["config"], "Labels": c["config"].get("Labels") or {}},
                "HostConfig": c["config"].get("HostConfig") or {},
                "State": {"Status": status, "Running": c["running"]}}

    def _list(self, h: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        filters = json.loads(query.get("filters") or "{}")
        wanted = filters.get("label") or []
        out = []
        for cid, c in self.containers.items():
            labels = c["config"].get("Labels") or {}
            ok = all(
                (labels.get(f.split("=", 1)[0]) == f.split("=", 1)[1]) if "=" in f else f in labels for f in wanted
            )
            if ok and (c["running"] or query.get("all") in ("1", "true", "True")):
                out.append({"Id": cid, "Names": ["/" + c["name"]], "Labels": labels,
                            "State": "running" if c["running"] else "created", "Created": c["created"]})
        self._reply(h, 200, out)

    def _kill_all(self, cid: str) -> None:
        for proc in self.containers[cid]["procs"]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)

    # -- exec -----------------------------------------------------------------------------------

    def _exec_start(self, h: BaseHTTPRequestHandler, eid: str) -> None:
        e = self.execs[eid]
        cfg = e["config"]
        cid = e["container"]
        cmd = cfg["Cmd"]
        h.send_response(101, "UPGRADED")
        h.send_header("Content-Type", "application/vnd.docker.raw-stream")
        h.send_header("Connection", "Upgrade")
        h.send_header("Upgrade", "tcp")
        h.end_headers()
        h.wfile.flush()
        h.close_connection = True
        conn = h.connection
        if not cfg.get("AttachStdin"):
            if cmd[:3] == ["bash", "-c", KILL_SCRIPT] and cmd[4] == "0":  # kill everything of the user
                self._kill_all(cid)
            e["exit_code"] = 0
            conn.shutdown(2)
            return
        if any("kill" in part for part in cmd) and "-1" in " ".join(cmd):
            raise AssertionError(f"the fake daemon refuses to run {cmd!r} on the host")
        c = self.containers[cid]
        env = dict(x.split("=", 1) for x in (c["config"].get("Env") or []) + (cfg.get("Env") or []))
        cwd = cfg.get("WorkingDir") or c["config"].get("WorkingDir") or self.dir
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, start_new_session=True)
        c["procs"].append(proc)
        e["running"] = True
        send_lock = threading.Lock()

        def pump(stream: Any, kind: int) -> None:
            fd = stream.fileno()
            while True:
                data = os.read(fd, 65536)
                if not data:
                    return
                with send_lock:
                    try:
                        conn.sendall(struct.pack(">BxxxL", kind, len(data)) + data)
                    except OSError:
                        return

        pumps = [threading.Thread(target=pump, args=(proc.stdout, 1), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, 2), daemon=True)]
        for t in pumps:
            t.start()
        stdin_open = bool(cfg.get("AttachStdin"))
        while proc.poll() is None:
            if not stdin_open:
                time.sleep(0.02)
                continue
            readable, _, _ = select.select([conn], [], [], 0.05)
            if readable:
                data = conn.recv(65536)
                if not data:
                    stdin_open = False
                    continue
                try:
                    proc.stdin.write(data)
                    proc.stdin.flush()
                except OSError:
                    pass
        for t in pumps:
            t.join(timeout=10)
        e["exit_code"], e["running"] = proc.returncode, False
        try:
            conn.shutdown(2)
        except OSError:
            pass

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [p for c in self.containers.values() for p in c["procs"]]

    def stop(self) -> None:
        for cid in list(self.containers):
            self._kill_all(cid)
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    return DockerBackend(LIMITS, image="agentrl/sandbox:test", client=fake.client(), workdir=str(home), **kw)


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
