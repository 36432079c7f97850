"""The base a LoRA run's checkpoints reference: the frozen model in Hugging Face format and a content hash of it.

A LoRA run writes its base once, when the adapters start (the warmed-up model, ``<output_dir>/hf_base``), and every
checkpoint of the run names it by path and hash instead of holding its weights. The hash is sha256 over the base's
``*.safetensors`` files in name order, each file's name and then its own sha256 (:data:`HASH_METHOD`; the files are
hashed at once, a thread each, so a base of many shards is read at the speed of several cores): computed once when
the base is written, and compared on resume, where a difference is refused (the adapters were trained on other
weights). A checkpoint records the method with the hash; one written with the earlier method (sha256 over the files'
names and bytes in one stream, :data:`STREAM_HASH_METHOD`) is checked with that.

Beside the hash, a checkpoint records each shard's size, modification time and status-change time as they were
before it was read (:func:`base_stamp`). Where every shard still has them, resume takes the hash as it was, without
reading the base again (tens of gigabytes for a large model); any difference, a shard more or fewer, a folder copied
(new times) or a checkpoint without the record, and the base is hashed again. The status-change time cannot be set
by ``touch`` and moves on every write, so a shard rewritten with the old size and modification time is still hashed.
"""
from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_agentrl.distributed import broadcast_object, is_rank0

logger = logging.getLogger(__name__)

#: the base's folder under the run's output_dir
BASE_DIR = "hf_base"
#: how the hash is taken, recorded beside it
HASH_METHOD = "sha256 over the *.safetensors files' names and sha256 digests, in name order"
#: the method of checkpoints written before :data:`HASH_METHOD`: one stream of each file's name, then its bytes
STREAM_HASH_METHOD = "sha256 over the *.safetensors files (name, then bytes), in name order"
#: one shard's record: its name, size in bytes, modification and status-change times in ns
FileStamp = tuple[str, int, int, int]
_CHUNK = 16 << 20
#: files hashed at once
_HASH_THREADS = 8


class BaseError(ValueError):
    """A base that is missing or not the one the adapters were trained on; the message names the path and fix."""


@dataclass(frozen=True)
class BaseRef:
    """Where a LoRA run's base lies (an absolute path) and its content hash (:func:`base_hash`)."""

    path: str
    sha256: str
    #: how ``sha256`` was taken (:data:`HASH_METHOD`, or :data:`STREAM_HASH_METHOD` for an earlier run's base)
    method: str = HASH_METHOD
    #: the shards as they were when hashed (:func:`base_stamp`); empty: unknown, so a check reads the base
    files: tuple[FileStamp, ...] = ()

    @classmethod
    def hashed(cls, directory: str | Path) -> BaseRef:
        """The reference of the base in ``directory``: its shards' stamps taken before they are read, then the hash
        (a shard written meanwhile fails the stamp later and is read again)."""
        files = base_stamp(directory)
        return cls(str(directory), base_hash(directory), HASH_METHOD, files)

    @classmethod
    def from_meta(cls, entry: dict[str, Any], checkpoint_dir: str | Path) -> BaseRef:
        """The base a checkpoint's meta.json entry names, its folder as found now (:func:`resolve_base`; BaseError
        when missing), with its hash, how it was taken (an entry of the earlier method says so) and the shards'
        stamps (none in an entry written before they were recorded)."""
        files = tuple((str(n), int(size), int(mtime), int(ctime)) for n, size, mtime, ctime in entry.get("files", ()))
        return cls(str(resolve_base(entry, checkpoint_dir)), entry["sha256"], entry.get("hash", STREAM_HASH_METHOD),
                   files)

    def to_meta(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """The base's entry of a checkpoint's meta.json: the path, the same relative to the checkpoint folder (found
        when a run's output folder moved as a whole), the hash, how it was taken and the shards' stamps."""
        return {"path": self.path, "relative": os.path.relpath(self.path, Path(checkpoint_dir).resolve()),
                "sha256": self.sha256, "hash": self.method, "files": [list(f) for f in self.files]}


def base_stamp(directory: str | Path) -> tuple[FileStamp, ...]:
    """Each ``*.safetensors`` file of ``directory`` in name order: ``(name, size, st_mtime_ns, st_ctime_ns)``."""
    out = []
    for f in sorted(Path(directory).glob("*.safetensors")):
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def base_hash(directory: str | Path, method: str = HASH_METHOD) -> str:
    """The sha256 hex digest of a Hugging Face checkpoint folder's ``*.safetensors`` files by ``method`` (module doc);
    BaseError when it holds none, or for a method this version does not know."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise BaseError(f"lora: the base '{directory}' holds no *.safetensors file; it is not a Hugging Face "
                        "checkpoint folder written by a LoRA run")
    digest = hashlib.sha256()
    if method == STREAM_HASH_METHOD:
        for f in files:
            digest.update(f.name.encode() + b"\0")
            _update(digest, f)
        return digest.hexdigest()
    if method != HASH_METHOD:
        raise BaseError(f"lora: the base '{directory}' was hashed as {method!r}, which this version does not know "
                        f"(it knows {HASH_METHOD!r} and {STREAM_HASH_METHOD!r}); resume with the version that wrote "
                        "the checkpoint")
    with ThreadPoolExecutor(min(_HASH_THREADS, len(files)), thread_name_prefix="base-hash") as pool:
        digests = list(pool.map(lambda f: _update(hashlib.sha256(), f).digest(), files))
    for f, d in zip(files, digests):
        digest.update(f.name.encode() + b"\0" + d)
    return digest.hexdigest()


def _update(digest: Any, path: Path) -> Any:
    """``digest`` updated with the bytes of ``path`` (hashlib lets other threads run meanwhile)."""
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest


def resolve_base(entry: dict[str, str], checkpoint_dir: str | Path) -> Path:
    """The base folder a checkpoint's meta.json entry names: its path, else the same relative to the checkpoint
    (the run's folder moved); BaseError naming both when neither exists."""
    path = Path(entry["path"])
    if path.is_dir():
        return path
    moved = (Path(checkpoint_dir) / entry.get("relative", "")).resolve()
    if entry.get("relative") and moved.is_dir():
        return moved
    raise BaseError(f"the LoRA checkpoint '{checkpoint_dir}' needs its base '{path}' (the frozen model its adapters "
                    f"were trained on, written by the run as {BASE_DIR}/), which does not exist (nor '{moved}'); "
                    f"restore that folder (sha256 {entry['sha256']}) or resume from a checkpoint whose base exists")


def check_base(entry: dict[str, Any], checkpoint_dir: str | Path) -> BaseRef:
    """The base of a checkpoint's meta.json entry, checked (rank 0 checks, every rank gets the answer: collective):
    unchanged by its shards' stamps, else its hash recomputed and compared. The reference as found, with the stamps
    it was checked by, for the run's next checkpoints; BaseError when the base is missing or its hash differs."""
    answer: tuple[str, Any] | None = None
    if is_rank0():
        try:
            ref = BaseRef.from_meta(entry, checkpoint_dir)
            path = Path(ref.path)
            stamps = base_stamp(path)
            if ref.files and stamps == ref.files:
                logger.info("lora: the base '%s' is as it was hashed (its shards' sizes and times); not read again",
                            path)
            else:
                logger.info("lora: hashing the base '%s' to check it", path)
                found = base_hash(path, ref.method)
                if found != ref.sha256:
                    raise BaseError(f"the base '{path}' of the LoRA checkpoint '{checkpoint_dir}' has changed: its "
                                    f"sha256 is {found}, the adapters were trained on {ref.sha256}; put the original "
                                    "base back there (the run's hf_base/ as written when the adapters started), or "
                                    "resume from a checkpoint written on this base")
                ref = BaseRef(ref.path, ref.sha256, ref.method, stamps)
            answer = ("ok", ref)
        except BaseError as e:
            answer = ("error", str(e))
    status, found_ref = broadcast_object(answer)
    if status == "error":
        raise BaseError(found_ref)
    return found_ref
