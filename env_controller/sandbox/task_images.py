"""Task images: built from a Dockerfile context or imported from a root-filesystem tarball, tagged by a hash
of their content, built once per engine and cached per process.

::

    images = ImageCache(client)                                  # a docker.DockerClient
    tag = images.ensure(ImageSource.dockerfile("tasks/hello/environment"))   # blocking; built when missing
    future = images.submit(ImageSource.rootfs("tasks/base.tar.gz"))          # or in the background
    images.close()

Sources (:class:`ImageSource`):

- ``dockerfile``: a build context directory and the Dockerfile in it. Built with the engine's
  (legacy) builder, ``--network none`` and no pull: no registry is reachable here, so every ``FROM``
  must name an image the engine already has (checked before the build, with an error that says so;
  ``scratch`` and earlier stages are fine). Tag ``agentrl/task:d-<sha256 of the context>`` (every
  file's path, mode and bytes; ``.dockerignore`` is honoured by the build, not by the hash).
- ``rootfs``: a tarball that ``docker import`` takes (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.xz``),
  with the image settings ``workdir`` and ``env``. Tag ``agentrl/task:r-<sha256 of the bytes and
  settings>``.
- ``image``: a tag the engine has (loaded, imported or pulled elsewhere); used as is, checked present.
- ``builtin``: a root filesystem made on this machine by a registered builder (the terminal demo's
  families, from host binaries), imported like ``rootfs``.

The same content gives the same tag, so a second worker (or a restart) on the same engine finds the
image and builds nothing. Builds of different images run at once (``max_builds``) on their own
threads: a session of an image that is ready never waits for another image's build.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_controller.sandbox.docker_image import ImageBuildError

logger = logging.getLogger(__name__)

REPOSITORY = "agentrl/task"
#: how long a failed build is remembered (the same content fails the same way; a missing FROM may be
#: imported meanwhile)
FAILURE_TTL_S = 60.0
_FROM_RE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?\s*$", re.IGNORECASE)
#: builders of ``builtin`` images: name -> function writing a root filesystem into an empty directory
BUILTIN_ROOTFS: dict[str, Callable[[Path], None]] = {}


@dataclass(frozen=True)
class ImageSource:
    """Where a task's image comes from (see the module docstring). ``kind``: dockerfile | rootfs | image |
    builtin; ``path``: the context directory, the tarball, the tag or the builtin's name; ``dockerfile``:
    the Dockerfile's path inside the context; ``workdir`` / ``env``: image settings of an import."""

    kind: str
    path: str
    dockerfile: str = "Dockerfile"
    workdir: str = "/app"
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dockerfile(cls, context: str | os.PathLike[str], dockerfile: str = "Dockerfile") -> "ImageSource":
        """A build from ``context`` (a directory holding ``dockerfile``)."""
        return cls("dockerfile", str(Path(context).resolve()), dockerfile=dockerfile)

    @classmethod
    def from_rootfs(cls, tarball: str | os.PathLike[str], workdir: str = "/app",
                    env: dict[str, str] | None = None) -> "ImageSource":
        """An import of ``tarball`` with the image's working directory and environment."""
        return cls("rootfs", str(Path(tarball).resolve()), workdir=workdir, env=tuple(sorted((env or {}).items())))

    @classmethod
    def from_tag(cls, tag: str) -> "ImageSource":
        """An image the engine has."""
        return cls("image", tag)

    @classmethod
    def builtin(cls, name: str, workdir: str = "/app") -> "ImageSource":
        """A root filesystem of :data:`BUILTIN_ROOTFS`, imported."""
        return cls("builtin", name, workdir=workdir)

    def describe(self) -> str:
        """One phrase for logs and errors."""
        return {"dockerfile": f"the Dockerfile {Path(self.path) / self.dockerfile}",
                "rootfs": f"the root filesystem {self.path}", "image": f"the image {self.path}",
                "builtin": f"the builtin image {self.path}"}.get(self.kind, self.path)


def _hash_tree(root: Path) -> str:
    """sha256 over every file under ``root``: relative path, mode and bytes (symlinks by target), sorted."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = path.lstat()
            h.update(f"{rel}\0{st.st_mode:o}\0".encode())
            if path.is_symlink():
                h.update(os.readlink(path).encode())
            elif path.is_file():
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()


def _hash_file(path: Path, extra: str) -> str:
    h = hashlib.sha256(extra.encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def from_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's ``FROM`` lines name that are neither ``scratch`` nor an earlier stage
    (those with a ``$`` variable are left to the build)."""
    stages: set[str] = set()
    bases = []
    for line in dockerfile.read_text(errors="replace").splitlines():
        m = _FROM_RE.match(line)
        if not m:
            continue
        image, stage = m.group(1), m.group(2)
        if image.lower() != "scratch" and image.lower() not in stages and "$" not in image:
            bases.append(image)
        if stage:
            stages.add(stage.lower())
    return bases


def _import_changes(source: ImageSource) -> list[str]:
    return [f"WORKDIR {source.workdir}", *(f"ENV {k}={v}" for k, v in source.env), 'CMD ["bash"]']


class ImageCache:
    """Task images of one engine (see the module docstring). ``client``: a ``docker.DockerClient``;
    ``build_timeout_s``: limit on one build or import; ``max_builds``: builds at once."""

    def __init__(self, client: Any, build_timeout_s: float = 600.0, max_builds: int = 2) -> None:
        self.client = client
        self.build_timeout_s = float(build_timeout_s)
        self._lock = threading.Lock()
        self._futures: dict[ImageSource, tuple[Future[str], float]] = {}
        self._pool = ThreadPoolExecutor(max_builds, thread_name_prefix="agentrl-image-build")
        #: seconds each image took to build or import (0 when the engine had it), by tag
        self.build_s: dict[str, float] = {}

    def submit(self, source: ImageSource) -> "Future[str]":
        """The future tag of ``source``'s image: one build per source, shared by every caller (a failed one is
        retried after :data:`FAILURE_TTL_S`)."""
        with self._lock:
            entry = self._futures.get(source)
            if entry is not None:
                future, at = entry
                failed = future.done() and future.exception() is not None
                if not failed or time.monotonic() - at < FAILURE_TTL_S:
                    return future
            future = self._pool.submit(self._build, source)
            self._futures[source] = (future, time.monotonic())
            return future

    def ensure(self, source: ImageSource) -> str:
        """The tag of ``source``'s image, built when missing (blocking); ImageBuildError saying why not."""
        return self.submit(source).result()

    def ready(self, source: ImageSource) -> str | None:
        """The tag when the image is built, else None (never blocks)."""
        with self._lock:
            entry = self._futures.get(source)
        if entry is None or not entry[0].done() or entry[0].exception() is not None:
            return None
        return entry[0].result()

    def _has(self, tag: str) -> bool:
        import docker

        try:
            self.client.images.get(tag)
            return True
        except docker.errors.ImageNotFound:
            return False

    def _build(self, source: ImageSource) -> str:
        t0 = time.monotonic()
        if source.kind == "image":
            if not self._has(source.path):
                raise ImageBuildError(f"the image {source.path!r} is not in the Docker engine, and nothing is pulled "
                                      "here (no registry is reachable): load or import it first (docker load, "
                                      "docker import), or give the task a Dockerfile or a root-filesystem tarball")
            return source.path
        if source.kind == "dockerfile":
            tag = self._build_dockerfile(source)
        elif source.kind == "rootfs":
            path = Path(source.path)
            if not path.is_file():
                raise ImageBuildError(f"{source.describe()}: no such file")
            digest = _hash_file(path, "\n".join(_import_changes(source)))
            tag = f"{REPOSITORY}:r-{digest[:16]}"
            if not self._has(tag):
                self._import(path, tag, source)
        elif source.kind == "builtin":
            tag = self._build_builtin(source)
        else:
            raise ImageBuildError(f"unknown image source kind {source.kind!r}")
        self.build_s[tag] = round(time.monotonic() - t0, 3)
        return tag

    def _import(self, path: Path, tag: str, source: ImageSource) -> None:
        import docker

        repo, _, version = tag.partition(":")
        try:
            self.client.api.import_image_from_file(str(path), repository=repo, tag=version,
                                                   changes=_import_changes(source))
        except docker.errors.DockerException as e:
            raise ImageBuildError(f"docker import of {source.describe()} failed: {e}") from None
        if not self._has(tag):
            raise ImageBuildError(f"docker import of {source.describe()} made no image {tag}")
        logger.info("task image: imported %s as %s", source.describe(), tag)

    def _build_builtin(self, source: ImageSource) -> str:
        from env_controller.sandbox.docker_image import _tar

        builder = BUILTIN_ROOTFS.get(source.path)
        if builder is None:
            raise ImageBuildError(f"no builtin image {source.path!r}; known: {', '.join(sorted(BUILTIN_ROOTFS))}")
        with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
            root = Path(tmp) / "root"
            builder(root)
            data, digest = _tar(root)
            changes = "\n".join(_import_changes(source))
            tag = f"{REPOSITORY}:b-{hashlib.sha256(digest.encode() + changes.encode()).hexdigest()[:16]}"
            if not self._has(tag):
                tarball = Path(tmp) / "rootfs.tar"
                tarball.write_bytes(data)
                self._import(tarball, tag, source)
        return tag

    def _build_dockerfile(self, source: ImageSource) -> str:
        import docker

        context = Path(source.path)
        dockerfile = context / source.dockerfile
        if not dockerfile.is_file():
            raise ImageBuildError(f"{source.describe()}: no such file")
        tag = f"{REPOSITORY}:d-{_hash_tree(context)[:16]}"
        if self._has(tag):
            return tag
        for base in from_images(dockerfile):
            if not self._has(base):
                raise ImageBuildError(
                    f"{dockerfile}: FROM {base}: that image is not in the Docker engine, and builds here pull "
                    "nothing (no registry is reachable): load or import it first (docker load / docker import, "
                    "e.g. from a root filesystem built on this machine), or start FROM an image the engine has")
        deadline = time.monotonic() + self.build_timeout_s
        log: list[str] = []
        try:
            stream = self.client.api.build(path=str(context), dockerfile=source.dockerfile, tag=tag, rm=True,
                                           forcerm=True, pull=False, network_mode="none", decode=True,
                                           timeout=int(self.build_timeout_s))
            for chunk in stream:
                if "stream" in chunk:
                    log.append(chunk["stream"])
                if "error" in chunk:
                    raise ImageBuildError(f"building {source.describe()} failed: {chunk['error'].strip()}; the "
                                          f"build's output ended with: {''.join(log)[-1500:]}")
                if time.monotonic() > deadline:
                    raise ImageBuildError(f"building {source.describe()} ran past {self.build_timeout_s:g} s "
                                          "(the task's build timeout)")
        except docker.errors.DockerException as e:
            raise ImageBuildError(f"building {source.describe()} failed: {e}") from None
        if not self._has(tag):
            raise ImageBuildError(f"building {source.describe()} made no image {tag}: {''.join(log)[-1500:]}")
        logger.info("task image: built %s as %s", source.describe(), tag)
        return tag

    def close(self) -> None:
        """Stop taking builds; those running finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)
