"""A fake Docker daemon that speaks the Engine HTTP API on a unix socket (the docker sandbox tests, and the
os_shell task's test on the docker backend): containers kept in memory, each attached exec run as a host process
in the sandbox's working directory."""
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
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

docker = pytest.importorskip("docker", reason="the docker SDK is not installed (pip install docker)")

from env_controller.sandbox.docker import (  # noqa: E402
    KILL_SCRIPT,
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
