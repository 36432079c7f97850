"""The base a LoRA run's checkpoints reference: the frozen model in Hugging Face format and a content hash of it.

A LoRA run writes its base once, when the adapters start (the warmed-up model, ``<output_dir>/hf_base``), and every
checkpoint of the run names it by path and hash instead of holding its weights. The hash is sha256 over the base's
``*.safetensors`` files in name order, each file's name and then its own sha256 (:data:`HASH_METHOD`; the files are
hashed at once, a thread each, so a base of many shards is read at the speed of several cores): computed once when
the base is written, recomputed on resume, where a difference is refused (the adapters were trained on other
weights). A checkpoint records the method with the hash; one written with the earlier method (sha256 over the files'
names and bytes in one stream, :data:`STREAM_HASH_METHOD`) is checked with that.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_agentrl.distributed import broadcast_object, is_rank0

#: the base's folder under the run's output_dir
BASE_DIR = "hf_base"
#: how the hash is taken, recorded beside it
HASH_METHOD = "sha256 over the *.safetensors files' names and sha256 digests, in name order"
#: the method of checkpoints written before :data:`HASH_METHOD`: one stream of each file's name, then its bytes
STREAM_HASH_METHOD = "sha256 over the *.safetensors files (name, then bytes), in name order"
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

    @classmethod
    def from_meta(cls, entry: dict[str, str], checkpoint_dir: str | Path) -> BaseRef:
        """The base a checkpoint's meta.json entry names, its folder as found now (:func:`resolve_base`; BaseError
        when missing), with its hash and how it was taken (an entry of the earlier method says so)."""
        return cls(str(resolve_base(entry, checkpoint_dir)), entry["sha256"], entry.get("hash", STREAM_HASH_METHOD))

    def to_meta(self, checkpoint_dir: str | Path) -> dict[str, str]:
        """The base's entry of a checkpoint's meta.json: the path, the same relative to the checkpoint folder (found
        when a run's output folder moved as a whole), the hash and how it was taken."""
        return {"path": self.path, "relative": os.path.relpath(self.path, Path(checkpoint_dir).resolve()),
                "sha256": self.sha256, "hash": self.method}


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


def check_base(entry: dict[str, str], checkpoint_dir: str | Path) -> Path:
    """The base folder of a checkpoint's meta.json entry, its hash recomputed and compared (rank 0 reads, every rank
    gets the answer: collective). BaseError when it is missing or its hash differs."""
    answer: tuple[str, str] | None = None
    if is_rank0():
        try:
            ref = BaseRef.from_meta(entry, checkpoint_dir)
            path = Path(ref.path)
            found = base_hash(path, ref.method)
            if found != ref.sha256:
                raise BaseError(f"the base '{path}' of the LoRA checkpoint '{checkpoint_dir}' has changed: its sha256 "
                                f"is {found}, the adapters were trained on {entry['sha256']}; put the original base "
                                "back there (the run's hf_base/ as written when the adapters started), or resume from "
                                "a checkpoint written on this base")
            answer = ("ok", str(path))
        except BaseError as e:
            answer = ("error", str(e))
    status, text = broadcast_object(answer)
    if status == "error":
        raise BaseError(text)
    return Path(text)
