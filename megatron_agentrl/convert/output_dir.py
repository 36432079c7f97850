"""The converters' output directory: checked before any work, written whole or not at all.

:func:`check_output_dir` refuses an output path that cannot become a directory (a file, a parent that
is a file or not writable, a non-empty directory without ``overwrite``). :func:`atomic_output_dir`
hands out a temporary directory next to the destination (same filesystem: ``.<name>.tmp-<host>-<pid>``)
and renames it into place when the conversion ends; on any failure, KeyboardInterrupt included, it
removes the temporary directory and the parents it created, so a failed conversion leaves nothing
behind. The temporary directory of an earlier run on this host whose process is gone is removed.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from megatron_agentrl.convert.base import ConversionError

logger = logging.getLogger(__name__)


def check_output_dir(out_dir: str | Path, overwrite: bool, source: str | Path | None = None) -> Path:
    """``out_dir`` as a Path; ConversionError naming it unless a conversion can write it (and it is
    not ``source``, the input checkpoint)."""
    out = Path(out_dir)
    if source is not None and _absolute(out) == _absolute(Path(source)):
        raise ConversionError(f"output directory '{out}' is the input checkpoint; choose another out_dir / --out-dir")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output directory '{out}' exists and is not a directory; "
                              "choose a new directory path for out_dir / --out-dir")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"output directory '{out}' is not empty; choose a new one or pass overwrite / --overwrite")
    anc = _existing_ancestor(_absolute(out).parent)
    if not anc.is_dir():
        raise ConversionError(f"output directory '{out}' cannot be created: '{anc}' is a file, not a directory; "
                              "choose another out_dir / --out-dir")
    # the output is written next to out_dir first, so its parent must be writable even when out_dir exists
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConversionError(f"output directory '{out}' cannot be written: '{anc}' is not writable; "
                              "choose an out_dir / --out-dir in a directory you can write to")
    return out


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool, stale: Sequence[str] = ()) -> Iterator[Path]:
    """A temporary directory to write the output into, moved to ``out`` when the block ends.

    ``out`` absent or empty: the temporary directory is renamed to ``out``. ``out`` not empty
    (``overwrite``): the files matching the glob patterns ``stale`` (the old weights) are removed
    from it, then each entry of the temporary directory replaces its namesake there; other files
    stay. On an exception nothing of the conversion is left; an OSError from the system becomes a
    ConversionError naming the file.
    """
    out = Path(out)
    target = _absolute(out)
    created = _make_parents(out, target.parent)
    tmp = target.parent / f".{target.name}.tmp-{_host()}-{os.getpid()}"
    try:
        _remove_dead_runs(target.parent, target.name)
        if tmp.exists():  # left by an earlier process with this pid (or an earlier call of this one)
            shutil.rmtree(tmp)
        try:
            tmp.mkdir()
        except OSError as e:
            raise ConversionError(f"output directory '{out}' cannot be written: {e.strerror} in '{tmp.parent}'; "
                                  "choose an out_dir / --out-dir in a directory you can write to") from e
        yield tmp
        _publish(tmp, target, overwrite, stale)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in reversed(created):  # deepest last in the list: remove it first
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and e.errno is not None:  # from the system, not one of our messages
            where = f": '{e.filename}'" if e.filename else ""
            raise ConversionError(f"writing output directory '{out}' failed: {e.strerror}{where}; nothing was "
                                  "written (check the free space and permissions there)") from e
        raise


def _absolute(path: Path) -> Path:
    """``path`` absolute, with ``..`` and symlinks resolved: the temporary directory then sits next to the
    real destination (a link to other storage is followed, not replaced)."""
    return Path(os.path.realpath(path))


def _existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of ``path`` (or ``path`` itself) that exists."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _make_parents(out: Path, parent: Path) -> list[Path]:
    """Create the missing parents of ``out``; returns those created, outermost first."""
    missing = []
    p = parent
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as e:
        for d in reversed(created):
            d.rmdir()
        raise ConversionError(f"output directory '{out}' cannot be created: {e.strerror}: '{e.filename}'; "
                              "choose another out_dir / --out-dir") from e
    return created


def _host() -> str:
    # the host name in the temporary directory's name keeps runs on hosts sharing a filesystem apart
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_dead_runs(parent: Path, name: str) -> None:
    """Remove the temporary directories for ``name`` of earlier runs on this host whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)")
    for d in parent.glob(f".{glob.escape(name)}.tmp-*"):
        m = pattern.fullmatch(d.name)
        if m is None or m["host"] != _host() or int(m["pid"]) == os.getpid() or _alive(int(m["pid"])):
            continue
        logger.info("removing %s, left by an earlier conversion (pid %s) that did not finish", d, m["pid"])
        shutil.rmtree(d, ignore_errors=True)


def _publish(tmp: Path, out: Path, overwrite: bool, stale: Sequence[str]) -> None:
    """Move the finished ``tmp`` to ``out`` (see :func:`atomic_output_dir`)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        try:
            os.replace(tmp, out)  # rename(2) replaces an empty directory
            return
        except OSError:
            if not out.is_dir() or not any(out.iterdir()):
                raise
    if not overwrite:  # another process filled it while this one converted
        raise ConversionError(f"output directory '{out}' was filled by someone else during the conversion; "
                              "choose a new one or pass overwrite / --overwrite")
    for pattern in stale:
        for old in out.glob(pattern):
            if old.is_file():
                old.unlink()
    for entry in tmp.iterdir():
        dst = out / entry.name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(entry, dst)
    tmp.rmdir()
