"""The OS task's Docker image, made on this machine: host binaries and their libraries, ``docker import``-ed.

No registry is needed: :func:`build_rootfs` copies ``bash``, coreutils and the usual shell tools
of the host (each with the shared libraries ``ldd`` names and the dynamic loader) into a directory
laid out like a merged-/usr Debian root, with a ``user`` account (uid 1000) and its home;
:func:`ensure_image` imports it as ``agentrl/os-shell:<content hash>`` unless the engine already
has that tag, so the same host makes the same image and a rebuild is free. Any image with ``bash``
and coreutils works as well (AgentBench's OS images, ``ubuntu:22.04``): pass its name as the
task's ``image``.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPOSITORY = "agentrl/os-shell"
#: the uid and gid of the images' ``user`` account (/etc/passwd below), the owner of its home
USER_ID = 1000
#: what an agent of the OS task expects to find (missing ones are skipped with a log line)
DEFAULT_TOOLS: tuple[str, ...] = (
    "bash", "ls", "cat", "echo", "printf", "mkdir", "rmdir", "rm", "cp", "mv", "ln", "touch", "chmod", "chown",
    "head", "tail", "wc", "sort", "uniq", "cut", "tr", "tee", "paste", "join", "comm", "nl", "fold", "rev",
    "pwd", "env", "date", "sleep", "seq", "basename", "dirname", "realpath", "readlink", "stat", "du", "df",
    "find", "xargs", "grep", "egrep", "fgrep", "sed", "awk", "diff", "cmp", "md5sum", "sha256sum", "base64",
    "od", "id", "whoami", "hostname", "uname", "kill", "ps", "timeout", "nproc", "true", "false", "test",
    "expr", "yes", "split", "shuf", "tac", "tar", "gzip", "gunzip", "zcat", "mktemp",
)
_LDD_RE = re.compile(r"(/\S+)")
_USRMERGE = ("bin", "sbin", "lib", "lib64")


class ImageBuildError(RuntimeError):
    """The image could not be made (a tool, ``ldd`` or the engine failed); the message says which."""


def _libraries(binary: str) -> list[str]:
    """The shared libraries (and loader) that ``binary`` loads, as absolute paths, from ``ldd``."""
    try:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImageBuildError(f"ldd {binary} failed: {e}; install libc-bin") from None
    if "not a dynamic executable" in out.stdout + out.stderr:
        return []
    return [m.group(1) for line in out.stdout.splitlines() if (m := _LDD_RE.search(line.split("=>")[-1]))]


def _under(root: Path, path: str) -> Path:
    """``path`` (absolute) inside ``root``, with /bin, /lib, ... mapped to /usr as in a merged-/usr root."""
    parts = Path(path).parts[1:]
    if parts and parts[0] in _USRMERGE:
        parts = ("usr", *parts)
    return root.joinpath(*parts)


def _copy_library(root: Path, lib: str) -> None:
    """Copy ``lib``'s file into ``root`` and link the name it was loaded by to it."""
    real = os.path.realpath(lib)
    dest = _under(root, real)
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(real, dest)
    named = _under(root, os.path.join(os.path.realpath(os.path.dirname(lib)), os.path.basename(lib)))
    if named != dest and not named.exists():
        named.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dest, named.parent), named)


def build_rootfs(root: str | os.PathLike[str], tools: Sequence[str] = DEFAULT_TOOLS) -> list[str]:
    """Lay out a root filesystem at ``root`` (an empty or missing directory) holding ``tools``.

    Returns the tools found on the host and copied (``bash`` is required: ImageBuildError without it).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc", "tmp", "root", "home/user", "proc", "dev", "sys",
              "var/tmp", "run"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for d in _USRMERGE:
        if not (root / d).is_symlink():
            os.symlink(f"usr/{d}", root / d)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "var/tmp", 0o1777)
    found = []
    for name in tools:
        path = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
        if path is None:
            logger.info("os-shell image: %s is not on this host; left out", name)
            continue
        real = os.path.realpath(path)
        shutil.copy2(real, root / "usr/bin" / name)
        for lib in _libraries(real):
            _copy_library(root, lib)
        found.append(name)
    if "bash" not in found:
        raise ImageBuildError("bash is not on this host; the OS task's image needs it (apt-get install bash)")
    os.symlink("bash", root / "usr/bin/sh")
    (root / "etc/passwd").write_text(f"root:x:0:0:root:/root:/bin/bash\n"
                                     f"user:x:{USER_ID}:{USER_ID}:user:/home/user:/bin/bash\n"
                                     "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    (root / "etc/group").write_text(f"root:x:0:\nuser:x:{USER_ID}:\nnogroup:x:65534:\n")
    (root / "etc/hostname").write_text("sandbox\n")
    return found


def _tar(root: Path) -> tuple[bytes, str]:
    """The root filesystem as an uncompressed tar (sorted, zeroed times: the same tree gives the same bytes)
    and its sha256. Every file is root's, whoever built the tree, but the ``user`` account's home, which is
    its: a builder's own uid on ``/usr/bin`` or ``/etc`` would hand them to a sandbox user of that uid."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(_walk(root)):
            rel = path.relative_to(root)
            info = tar.gettarinfo(str(path), arcname=str(rel))
            info.mtime = 0
            info.uname = info.gname = ""
            info.uid = info.gid = USER_ID if rel.parts[:2] == ("home", "user") else 0
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _walk(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in dirnames + filenames:
            yield base / name


def ensure_image(client: Any, workdir: str | os.PathLike[str], tools: Sequence[str] = DEFAULT_TOOLS) -> str:
    """The tag of the OS task's image in the engine of ``client`` (a ``docker.DockerClient``), built and
    imported when missing. ``workdir``: scratch space for the root filesystem (removed afterwards)."""
    import docker

    root = Path(workdir) / "os-shell-rootfs"
    shutil.rmtree(root, ignore_errors=True)
    try:
        build_rootfs(root, tools)
        data, digest = _tar(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tag = f"{REPOSITORY}:{digest[:16]}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    try:
        client.api.import_image_from_data(data, repository=REPOSITORY, tag=digest[:16],
                                          changes=["WORKDIR /home/user", "ENV HOME=/home/user",
                                                   'CMD ["bash"]'])
        client.images.get(tag)
    except docker.errors.DockerException as e:
        raise ImageBuildError(f"docker import of the OS task's image ({len(data) >> 20} MB) failed: {e}") from None
    logger.info("os-shell image: imported %s (%d MB)", tag, len(data) >> 20)
    return tag
