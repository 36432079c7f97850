"""megatron-core distributed checkpoints (``torch_dist`` format): streaming write and read,
and save / load of a live model at any TP x PP.

Layout of a checkpoint directory written here (megatron-core's own files first):

* ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}`` (megatron's ``save_config``);
* ``common.pt``: the non-sharded part of the state dict (empty for a model);
* ``.metadata`` and ``__<rank>_<i>.distcp``: the torch.distributed.checkpoint (DCP) files;
  every tensor is stored under its megatron ``sharded_state_dict`` key, layer tensors stacked
  to ``[num_layers, ...]``, vocab tensors padded (see :mod:`megatron_agentrl.convert.base`);
* ``agentrl_checkpoint.json``: family, architecture, vocab sizes, the TP x PP and dtype it was
  written with (ours; megatron ignores it);
* ``hf/``: the Hugging Face ``config.json`` plus tokenizer and generation files, so that
  ``megatron_to_hf`` can rebuild a complete HF directory.

Because DCP reshards on load, a checkpoint written at one TP x PP loads at any other
(:func:`load_megatron_checkpoint`); the vocab tensors are declared ``allow_shape_mismatch`` by
megatron, so a different padded vocab (another TP) loads too.

:func:`write_dcp_streaming` and :class:`DistCheckpointReader` work in one process without
torch.distributed and touch one tensor chunk at a time.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_agentrl.config import read_mapping_file
from megatron_agentrl.convert.base import ConversionError, GPTMapping, one_line
from megatron_agentrl.lora.adapters import is_adapter
from rollout_sglang.dtypes import dtype_name
from rollout_sglang.engines.local import resolve_dtype

logger = logging.getLogger(__name__)

INFO_FILE = "agentrl_checkpoint.json"
HF_ASSETS_DIR = "hf"
FORMAT = "megatron-agentrl/torch_dist"
FORMAT_VERSION = 1
# megatron-core's metadata.json for its torch_dist format (dist_checkpointing.core.CheckpointingConfig)
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}

#: the folder of a run's checkpoint ``step_<k>/`` that holds the model and its optimizer state (a torch_dist checkpoint)
TRAINING_MODEL_DIR = "model_optim"
#: a training checkpoint (megatron's, or a run's ``step_<k>/model_optim``) stores its optimizer state and the KL
#: reference beside the model under these key prefixes; conversion reads the model alone
TRAINING_STATE_PREFIXES = ("optimizer.", "reference.")

# Files copied along with config.json: tokenizer, chat template, generation defaults.
HF_ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
)

def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"float32" | "bfloat16" | "float16"`` (or a torch dtype) -> torch dtype; None / "auto" -> None."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    try:
        return resolve_dtype(name)
    except ValueError:
        raise ConversionError(f"dtype={name!r} must be one of auto, float32, bfloat16, float16") from None


@dataclass
class CheckpointInfo:
    """Contents of ``agentrl_checkpoint.json``: what a checkpoint holds and how it was written.

    vocab_size: the model's real vocab; padded_vocab_size: rows stored for the vocab tensors
    (a multiple of ``make_vocab_size_divisible_by * tp``); tp / pp: the layout it was written
    with (any other loads); dtype: the stored dtype of the weights.
    """

    model_type: str
    architecture: str
    num_layers: int
    vocab_size: int
    padded_vocab_size: int
    make_vocab_size_divisible_by: int
    tie_word_embeddings: bool
    tp: int
    pp: int
    dtype: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def save(self, ckpt_dir: Path) -> None:
        """Write ``agentrl_checkpoint.json`` into ``ckpt_dir``."""
        (ckpt_dir / INFO_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_checkpoint_info(ckpt_dir: str | Path) -> CheckpointInfo | None:
    """The :class:`CheckpointInfo` of ``ckpt_dir``, or None for a checkpoint without one
    (e.g. saved by plain megatron code); ConversionError naming the file when it is damaged."""
    path = Path(ckpt_dir) / INFO_FILE
    if not path.is_file():
        return None
    data = read_mapping_file(path, "json", f"'{path}'")
    fields = {f.name: f for f in dataclasses.fields(CheckpointInfo)}
    lacking = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
    if lacking:
        raise ConversionError(f"'{path}' lacks {', '.join(lacking)}; copy the checkpoint again, or delete the file "
                              "and pass hf_config / --hf-config")
    return CheckpointInfo(**{k: v for k, v in data.items() if k in fields})


def check_is_megatron_checkpoint(ckpt_dir: str | Path) -> Path:
    """``ckpt_dir`` as a Path; ConversionError / FileNotFoundError naming it unless it is a
    megatron-core ``torch_dist`` checkpoint with every data file its metadata lists, each as long
    as the metadata says."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(ckpt_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"'{ckpt_dir}' is not a directory; give a megatron distributed checkpoint directory")
    meta = root / "metadata.json"
    if not meta.is_file() or not (root / ".metadata").is_file():
        looks_hf = (root / "config.json").is_file()
        hint = " (it looks like a Hugging Face checkpoint: use hf-to-megatron)" if looks_hf else ""
        raise ConversionError(f"'{root}' is not a megatron-core distributed checkpoint: metadata.json and .metadata "
                              f"are required{hint}")
    backend = read_mapping_file(meta, "json", f"'{meta}'").get("sharded_backend")
    if backend != "torch_dist":
        raise ConversionError(
            f"'{root}': sharded_backend={backend!r}; only megatron's 'torch_dist' format is supported")
    try:
        md = FileSystemReader(str(root)).read_metadata()
        ends: dict[str, int] = {}
        for s in md.storage_data.values():
            ends[s.relative_path] = max(ends.get(s.relative_path, 0), s.offset + s.length)
    except Exception as e:  # a damaged pickle raises whatever unpickling it hits
        raise ConversionError(f"'{root / '.metadata'}' cannot be read ({one_line(e)}); the checkpoint is damaged "
                              "or incomplete: copy it again") from None
    missing = [f for f in sorted(ends) if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) {missing} listed in '{root / '.metadata'}' are missing; "
                                "copy the complete checkpoint directory")
    for f, end in sorted(ends.items()):
        size = (root / f).stat().st_size
        if size < end:
            raise ConversionError(f"'{root / f}' is truncated: {size} bytes, '{root / '.metadata'}' places data up "
                                  f"to byte {end}; copy the complete checkpoint directory")
    return root


@contextmanager
def unwrapped_checkpoint_errors() -> Iterator[None]:
    """Raise the exception inside torch.distributed.checkpoint's CheckpointException (whose message is a
    whole traceback) as itself, so that a ConversionError stays one and Ctrl-C stays a KeyboardInterrupt."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        if len(failures) == 1 and isinstance(failures[0][0], BaseException):
            raise failures[0][0] from None
        raise


def write_megatron_common_files(ckpt_dir: Path) -> None:
    """megatron-core's ``metadata.json`` (what ``dist_checkpointing.core.save_config`` writes for
    the torch_dist / torch backends) and an empty ``common.pt`` (the common state dict of a model).
    Written directly, so that converting does not import megatron-core."""
    (ckpt_dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    torch.save({}, ckpt_dir / "common.pt")


def copy_hf_assets(src: Path | None, dst: Path, config: dict[str, Any] | None = None) -> list[str]:
    """Copy config.json, tokenizer and generation files that exist in ``src`` (may be None) to
    ``dst``; ``config`` (a dict) replaces config.json when given. Returns the names written."""
    dst.mkdir(parents=True, exist_ok=True)
    written = []
    for name in HF_ASSET_FILES:
        if name == "config.json" and config is not None:
            (dst / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            written.append(name)
        elif src is not None and (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            written.append(name)
    return written


# ----------------------------------------------------------------------------- streaming write
@dataclass(frozen=True)
class StoredTensor:
    """One checkpoint key to write: global shape, dtype and the chunks (offsets, sizes) that
    make it up (chunks must tile the global shape)."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def write_dcp_streaming(ckpt_dir: Path, tensors: Iterable[StoredTensor],
                        produce: Callable[[str, tuple[int, ...], tuple[int, ...]], Tensor],
                        checkpoint_id: Path | None = None) -> None:
    """Write a torch.distributed.checkpoint with one data file, producing each chunk on demand.

    ``produce(key, offsets, sizes)`` returns the chunk's data (shape ``sizes``, the declared
    dtype); it is called once per chunk, in the order given, and the chunk is written and
    dropped before the next one is produced, so peak memory is about one chunk. No process
    group is needed. ``checkpoint_id``: the path the metadata records (default ``ckpt_dir``; the
    destination when ``ckpt_dir`` is a temporary directory renamed to it later). An exception of
    ``produce`` is raised as itself.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    specs = list(tensors)

    class _StreamingSavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for st in specs:
                props = TensorProperties(dtype=st.dtype)
                for offsets, sizes in st.chunks:
                    items.append(WriteItem(
                        index=MetadataIndex(st.key, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                            properties=props, size=torch.Size(st.global_shape)),
                    ))
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> Tensor:
            chunk = write_item.tensor_data.chunk  # type: ignore[union-attr]
            t = produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
            if tuple(t.shape) != tuple(chunk.sizes):
                raise RuntimeError(f"{write_item.index.fqn}: produced {tuple(t.shape)}, expected {tuple(chunk.sizes)}")
            return t

    class _Writer(dcp.FileSystemWriter):
        def storage_meta(self) -> StorageMeta | None:
            return StorageMeta(checkpoint_id=checkpoint_id or ckpt_dir, save_id=self.save_id)

    writer = _Writer(str(ckpt_dir), single_file_per_rank=True, thread_count=1, sync_files=True)
    with warnings.catch_warnings(), unwrapped_checkpoint_errors():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(), no_dist=True)


# ------------------------------------------------------------------------------ streaming read
class DistCheckpointReader:
    """Reads pieces of tensors of a ``torch_dist`` checkpoint without torch.distributed.

    Args:
        ckpt_dir: a megatron-core distributed checkpoint directory (checked with
            :func:`check_is_megatron_checkpoint`).
    """

    def __init__(self, ckpt_dir: str | Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.root = check_is_megatron_checkpoint(ckpt_dir)
        self._metadata = FileSystemReader(str(self.root)).read_metadata()
        self.tensors: dict[str, Any] = {k: v for k, v in self._metadata.state_dict_metadata.items()
                                        if isinstance(v, TensorStorageMetadata)}
        self._by_first: dict[str, dict[int, list[Any]] | None] = {}

    def _metadata_for(self, key: str, offset0: int, size0: int) -> Any:
        """``key``'s storage metadata, with only the stored chunks at ``offset0`` on the first axis when the
        piece is one element thick there and every stored chunk is too (stacked layers and experts): finding
        the chunks of a piece then costs the chunks of one layer, not of all of them."""
        md = self.tensors[key]
        if key not in self._by_first:
            index: dict[int, list[Any]] | None = {}
            for c in md.chunks:
                if c.sizes[0] != 1:
                    index = None
                    break
                index.setdefault(c.offsets[0], []).append(c)
            self._by_first[key] = index
        index = self._by_first[key]
        if index is None or size0 != 1:
            return md
        return dataclasses.replace(md, chunks=index.get(offset0, []))

    def keys(self) -> list[str]:
        """Stored tensor keys of the model (ShardedObjects such as ``_extra_state`` and a training checkpoint's
        optimizer and reference state are left out)."""
        return [k for k in self.tensors if not k.startswith(TRAINING_STATE_PREFIXES)]

    def shape(self, key: str) -> tuple[int, ...]:
        """Global shape of ``key`` as stored."""
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of ``key``."""
        return self.tensors[key].properties.dtype

    def read(self, requests: Mapping[str, tuple[str, tuple[int, ...], tuple[int, ...]]],
             dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Read pieces: ``{name: (key, offsets, sizes)}`` -> ``{name: tensor of shape sizes}``.

        A piece may span several stored chunks (it is resharded through
        ``torch.distributed.checkpoint.load``) but must lie inside the stored global shape. A
        piece inside one stored chunk is returned as a view of that chunk as loaded, without a
        second copy (peak memory: the chunk). ``dtype``: of the returned tensors (default: as
        stored).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        out: dict[str, Tensor] = {}
        targets: dict[str, Tensor] = {}
        resharded: list[ReadItem] = []
        for name, (key, offsets, sizes) in requests.items():
            if key not in self.tensors:
                raise KeyError(f"checkpoint '{self.root}' has no tensor '{key}'")
            glob = self.shape(key)
            if len(offsets) != len(glob) or any(o + s > g for o, s, g in zip(offsets, sizes, glob)):
                raise ValueError(f"piece {offsets}+{sizes} of '{key}' lies outside its stored shape {glob}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            # The destination of each read is named after the piece (not the key), so that several
            # pieces of one key (e.g. two layers) get their own targets.
            md = self._metadata_for(key, offsets[0], sizes[0]) if offsets else self.tensors[key]
            items = [dataclasses.replace(it, dest_index=dataclasses.replace(it.dest_index, fqn=name))
                     for it in create_read_items_for_chunk_list(key, md, [chunk])]
            if len(items) == 1 and tuple(items[0].lengths) == tuple(sizes) and self._plain(items[0]):
                t = self._load_chunk(items[0])
                for dim, (off, length) in enumerate(zip(items[0].storage_offsets, items[0].lengths)):
                    t = t.narrow(dim, off, length)
                out[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
                del t
            else:
                targets[name] = torch.empty(sizes, dtype=dtype or self.dtype(key))
                resharded += items
        if not resharded:
            return out

        class _PieceLoadPlanner(DefaultLoadPlanner):
            def create_local_plan(self) -> LoadPlan:
                return LoadPlan(resharded)

            def resolve_tensor(self, read_item: ReadItem) -> Tensor:
                t = targets[read_item.dest_index.fqn]
                for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                    t = t.narrow(dim, off, length)
                return t

            def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
                pass

        with warnings.catch_warnings(), unwrapped_checkpoint_errors():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load({}, storage_reader=FileSystemReader(str(self.root)), planner=_PieceLoadPlanner(), no_dist=True)
        out.update(targets)
        return out

    def _plain(self, item: Any) -> bool:
        """The stored chunk of ``item`` is a plain ``torch.save`` blob (no compression or other transform)."""
        info = self._metadata.storage_data.get(item.storage_index)
        return info is not None and not getattr(info, "transform_descriptors", None)

    def _load_chunk(self, item: Any) -> Tensor:
        """The whole stored chunk ``item`` reads from, loaded from its byte range of the data file
        (the same ``torch.load`` of the same bytes as ``FileSystemReader.read_data``)."""
        from torch.distributed.checkpoint.filesystem import _create_file_view

        info = self._metadata.storage_data[item.storage_index]
        path = self.root / info.relative_path
        with open(path, "rb") as f:
            try:
                return torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                  weights_only=True)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # what torch.load raises on bad bytes
                raise ConversionError(f"'{path}': the data of '{item.storage_index.fqn}' at byte {info.offset} "
                                      f"cannot be read ({one_line(e)}); the checkpoint is damaged: copy it "
                                      "again") from None


# ------------------------------------------------------------------------ family / shape checks
def check_checkpoint_matches(reader: DistCheckpointReader, mapping: GPTMapping, where: str) -> None:
    """Raise ConversionError unless the stored tensors are exactly those of ``mapping``'s model
    (same keys; layer stacks ``[num_layers, ...]``; shapes equal up to vocab padding); a LoRA run's adapters alone
    are refused naming LoRA."""
    expected: dict[str, tuple[int, ...]] = {}
    for mname in mapping.megatron_names():
        key, _, stack = mapping.checkpoint_key(mname)
        expected[key] = (*stack, *mapping.megatron_shape(mname))
    stored = set(reader.keys())
    adapters = sorted(k for k in stored if is_adapter(k))
    if adapters:
        raise ConversionError(
            f"{where} is a LoRA run's checkpoint: it holds {len(adapters)} adapter tensors (e.g. '{adapters[0]}') "
            "and no base weight, so it loads as no model. Continue it with checkpoint.resume=<its step_<k> folder>, "
            "or write it merged into its base with `agentrl convert megatron-to-hf --megatron-dir <its step_<k> "
            "folder>` and load that as model.checkpoint (with --peft-adapter: its adapters alone, in PEFT's format)")
    missing = sorted(set(expected) - stored)
    unexpected = sorted(stored - set(expected))
    if missing or unexpected:
        raise ConversionError(
            f"{where} does not hold a {mapping.model_type} model of this config "
            f"({mapping.num_layers} layers, qkv_bias={mapping.qkv_bias}, tied={mapping.tie_word_embeddings}): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}. Is it a checkpoint of another family, or is "
            "the HF config the wrong one?"
        )
    for key, want in expected.items():
        got = reader.shape(key)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            ok = len(got) == 2 and got[1] == want[1] and got[0] >= want[0]
        else:
            ok = got == want
        if not ok:
            raise ConversionError(f"{where}: tensor '{key}' has shape {got}, a {mapping.model_type} model of this "
                                  f"config needs {want}; the HF config does not belong to this checkpoint")


def _check_family(ckpt_dir: Path, hf_config: Any) -> CheckpointInfo | None:
    info = read_checkpoint_info(ckpt_dir)
    model_type = getattr(hf_config, "model_type", None)
    if info is not None and model_type is not None and info.model_type != model_type:
        raise ConversionError(
            f"'{ckpt_dir}' is a {info.model_type} ({info.architecture}) checkpoint, but the model config is "
            f"{model_type}; use the config the checkpoint was converted from ('{ckpt_dir / HF_ASSETS_DIR}')"
        )
    return info


# ---------------------------------------------------------------------- live model save / load
def sync_save_strategy() -> Any:
    """megatron's ``torch_dist`` save strategy, written synchronously in this process.

    megatron-core's own writer (``FileSystemWriterAsync``) forks writer processes, which a
    daemonic worker (and a CPU/gloo test) cannot do; this one calls
    ``torch.distributed.checkpoint.save`` directly with megatron's planner, producing the same
    files.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt = mcore_to_pyt_state_dict(sd, False)
            dcp.save(pyt, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False))

    return SyncTorchDistSaveStrategy("torch_dist", 1)


def save_megatron_checkpoint(model: Any, ckpt_dir: str | Path, hf_config: Any,
                             hf_assets_dir: str | Path | None = None,
                             make_vocab_size_divisible_by: int = 128) -> Path:
    """Save ``model`` (this rank's ``GPTModel`` stage, unwrapped) as a megatron-core distributed
    checkpoint in ``ckpt_dir``; collective over all ranks.

    Also writes ``agentrl_checkpoint.json`` and ``hf/`` (``hf_config`` as config.json, plus the
    tokenizer files found in ``hf_assets_dir``), so that ``megatron_to_hf`` can convert it.
    Requires ``initialize_parallel``.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_agentrl.convert import get_mapping
    from megatron_agentrl.parallel_layout import padded_vocab_size

    mapping = get_mapping(hf_config)
    root = Path(ckpt_dir)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = model.sharded_state_dict()
    dist_checkpointing.save(sd, str(root), sharded_strategy=sync_save_strategy())
    if dist.get_rank() == 0:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        dtype = next(model.parameters()).dtype
        CheckpointInfo(
            model_type=mapping.model_type, architecture=mapping.architecture, num_layers=mapping.num_layers,
            vocab_size=mapping.vocab_size,
            padded_vocab_size=padded_vocab_size(mapping.vocab_size, make_vocab_size_divisible_by, tp),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            tie_word_embeddings=mapping.tie_word_embeddings, tp=tp,
            pp=parallel_state.get_pipeline_model_parallel_world_size(), dtype=dtype_name(dtype),
        ).save(root)
        cfg = hf_config.to_dict()
        cfg["architectures"] = [mapping.architecture]
        copy_hf_assets(Path(hf_assets_dir) if hf_assets_dir else None, root / HF_ASSETS_DIR, cfg)
    dist.barrier()
    logger.info("saved megatron checkpoint to %s", root)
    return root


def load_megatron_checkpoint(model: Any, ckpt_dir: str | Path, hf_config: Any | None = None) -> None:
    """Load a megatron-core distributed checkpoint into ``model`` (this rank's ``GPTModel``
    stage, unwrapped) at the current TP x PP, whatever TP x PP it was written with.

    ``hf_config``: the model's config, checked against the checkpoint's family and tensor
    shapes (ConversionError naming both on a mismatch). ``_extra_state`` entries (TE fp8
    metadata) are not loaded. Collective over all ranks; requires ``initialize_parallel``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    root = check_is_megatron_checkpoint(ckpt_dir)
    if hf_config is not None:
        _check_family(root, hf_config)
        from megatron_agentrl.convert import get_mapping

        check_checkpoint_matches(DistCheckpointReader(root), get_mapping(hf_config), f"checkpoint '{root}'")
    sd = {k: v for k, v in model.sharded_state_dict().items()
          if not (isinstance(v, ShardedObject) or k.endswith("_extra_state"))}
    loaded = dist_checkpointing.load(sd, str(root))
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ConversionError(f"checkpoint '{root}' left parameters unloaded: missing {missing[:8]}, "
                              f"unexpected {list(result.unexpected_keys)[:8]}")
    logger.info("loaded megatron checkpoint %s", root)
