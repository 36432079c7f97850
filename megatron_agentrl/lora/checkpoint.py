"""The base a LoRA run's checkpoints reference: the frozen model in Hugging Face format and a content hash of it.

A LoRA run writes its base once, when the adapters start (the warmed-up model, ``<output_dir>/hf_base``), and every
checkpoint of the run names it by path and hash instead of holding its weights. The hash is sha256 over the bytes
of the base's ``*.safetensors`` files, in name order (each file's name, then its bytes): computed once when the base
is written, recomputed on resume, where a difference is refused (the adapters were trained on other weights).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_agentrl.distributed import broadcast_object, is_rank0

#: the base's folder under the run's output_dir
BASE_DIR = "hf_base"
#: how the hash is taken, recorded beside it
HASH_METHOD = "sha256 over the *.safetensors files (name, then bytes), in name order"
_CHUNK = 16 << 20


class BaseError(ValueError):
    """A base that is missing or not the one the adapters were trained on; the message names the path and fix."""


@dataclass(frozen=True)
class BaseRef:
    """Where a LoRA run's base lies (an absolute path) and its content hash (:func:`base_hash`)."""

    path: str
    sha256: str

    def to_meta(self, checkpoint_dir: str | Path) -> dict[str, str]:
        """The base's entry of a checkpoint's meta.json: the path, the same relative to the checkpoint folder (found
        when a run's output folder moved as a whole), the hash and how it was taken."""
        return {"path": self.path, "relative": os.path.relpath(self.path, Path(checkpoint_dir).resolve()),
                "sha256": self.sha256, "hash": HASH_METHOD}


def base_hash(directory: str | Path) -> str:
    """The sha256 hex digest of a Hugging Face checkpoint folder's ``*.safetensors`` files (module doc); BaseError
    when it holds none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise BaseError(f"lora: the base '{directory}' holds no *.safetensors file; it is not a Hugging Face "
                        "checkpoint folder written by a LoRA run")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


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
            path = resolve_base(entry, checkpoint_dir)
            found = base_hash(path)
            if found != entry["sha256"]:
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
