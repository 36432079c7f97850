"""Bad inputs to the converters: each ends in exit status 2 and one line on stderr that names the value and the
fix, and leaves nothing on disk; a conversion that fails or is interrupted while writing removes what it wrote."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_agentrl.cli import main
from tests.support.tiny_models import read_safetensors_dir, write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
SHARD2, SHARD3 = "model-00002-of-00007.safetensors", "model-00003-of-00007.safetensors"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen2 HF checkpoint in 7 shards and its megatron conversion (read only: cases copy them)."""
    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron

    base = tmp_path_factory.mktemp("ckpts")
    write_tiny_checkpoint("qwen2", base / "hf", max_shard_size="50KB")
    convert_hf_to_megatron(base / "hf", base / "mg", progress=False)
    return base / "hf", base / "mg"


def _snapshot(path: Path) -> dict[str, bytes] | bytes | None:
    """The bytes of ``path`` (a file, or each file under a directory), None when absent."""
    if not path.exists():
        return None
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(path.rglob("*"))}


def _temp_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.glob(".*.tmp-*"))


def _fails(argv: list[str], out: Path, needles: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``agentrl argv`` in process: exit status 2, one stderr line holding ``needles``, ``out`` untouched."""
    before = _snapshot(out)
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentrl: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert _snapshot(out) == before
    assert _temp_dirs(out.parent) == []
    return lines[0]


def _h2m(hf: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", "hf-to-megatron", "--hf-dir", str(hf), "--out-dir", str(out), "--no-progress", *extra]


def _m2h(mg: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", "megatron-to-hf", "--megatron-dir", str(mg), "--out-dir", str(out), "--no-progress", *extra]


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _edit_header(shard: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite the safetensors header of ``shard`` to ``edit(header)`` (or the edited header), data unchanged."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    new = edit(header)
    text = json.dumps(header if new is None else new).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _first_tensor(h: dict) -> dict:
    return h[next(k for k in h if k != "__metadata__")]


def _truncate(path: Path, by: int) -> None:
    path.write_bytes(path.read_bytes()[:-by])


# (id, how to spoil a copy of the HF checkpoint, extra options, what the message names)
HF_CASES: list[tuple[str, Callable[[Path], object], tuple[str, ...], list[str]]] = [
    ("truncated-shard", lambda d: _truncate(d / SHARD3, 1000), (), [SHARD3, "is truncated", "copy it again"]),
    ("header-lies-offsets", lambda d: _edit_header(d / SHARD3, lambda h: _first_tensor(h)["data_offsets"]
                                                   .__setitem__(1, 4024576)),
     (), [SHARD3, "bytes [0, 4024576)", "need 24576"]),
    ("header-lies-shape", lambda d: _edit_header(d / SHARD3, lambda h: _first_tensor(h)["shape"].__setitem__(0, 192)),
     (), [SHARD3, "[192, 64]", "need 49152"]),
    ("header-not-object", lambda d: _edit_header(d / SHARD3, lambda h: [1, 2]), (), [SHARD3, "JSON list"]),
    ("missing-shard", lambda d: (d / SHARD2).unlink(), (), [SHARD2, "missing", "copy the complete checkpoint"]),
    ("index-not-index", lambda d: _edit_json(d / "model.safetensors.index.json", weight_map=[1]), (),
     ["model.safetensors.index.json", "weight_map"]),
    ("config-list", lambda d: (d / "config.json").write_text("[1, 2]"), (), ["config.json", "JSON object", "list"]),
    ("config-not-json", lambda d: (d / "config.json").write_text("{bad"), (), ["config.json", "not valid JSON"]),
    ("config-missing-sizes", lambda d: _edit_json(d / "config.json", hidden_size=None, num_hidden_layers=None), (),
     ["lacks hidden_size, num_hidden_layers", "the config.json the weights were saved with"]),
    ("config-size-string", lambda d: _edit_json(d / "config.json", hidden_size="64"), (),
     ["hidden_size='64'", "positive integer"]),
    ("config-architectures-string", lambda d: _edit_json(d / "config.json", architectures="Qwen2ForCausalLM"), (),
     ["architectures='Qwen2ForCausalLM'", "list of class names"]),
    ("unknown-family", lambda d: _edit_json(d / "config.json", architectures=["GPTNeoXForCausalLM"],
                                            model_type="gpt_neox"), (), ["GPTNeoXForCausalLM", "Qwen2ForCausalLM"]),
    ("no-safetensors", lambda d: [p.unlink() for p in d.glob("model*")], (), ["no model.safetensors"]),
    ("empty-dir", lambda d: [p.unlink() for p in d.iterdir()], (), ["config.json", "does not exist"]),
    ("missing-dir", lambda d: shutil.rmtree(d), (), ["does not exist"]),
    ("vocab-multiple-0", lambda d: None, ("--make-vocab-size-divisible-by", "0"),
     ["make_vocab_size_divisible_by=0", "--make-vocab-size-divisible-by 128"]),
    ("vocab-multiple-negative", lambda d: None, ("--make-vocab-size-divisible-by", "-1"),
     ["make_vocab_size_divisible_by=-1"]),
    ("tp-0", lambda d: None, ("--tp", "0"), ["tp=0", "must be a positive integer"]),
    ("pp-negative", lambda d: None, ("--pp", "-2"), ["pp=-2", "must be a positive integer"]),
    ("tp-not-dividing", lambda d: None, ("--tp", "3"), ["tp=3 does not divide", "choose tp in [1, 2]"]),
    ("dtype", lambda d: None, ("--dtype", "fp8"), ["dtype='fp8'", "bfloat16"]),
]


def test_megatron_checkpoint_given_as_hf_input(ckpts: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _fails(_h2m(ckpts[1], tmp_path / "out"), tmp_path / "out", [str(ckpts[1]), "use megatron-to-hf"], capsys)


def _spoil_info(mg: Path, data: object) -> None:
    (mg / "agentrl_checkpoint.json").write_text(json.dumps(data))


# (id, how to spoil a copy of the megatron checkpoint, extra options, what the message names)
MG_CASES: list[tuple[str, Callable[[Path], object], tuple[str, ...], list[str]]] = [
    ("shard-size-0", lambda d: None, ("--max-shard-size", "0"), ["--max-shard-size '0'", "'5GB'"]),
    ("shard-size-negative", lambda d: None, ("--max-shard-size=-5GB",), ["'-5GB'", "positive byte count"]),
    ("shard-size-unit", lambda d: None, ("--max-shard-size", "5XB"), ["'5XB'", "'500MB'"]),
    ("shard-size-infinite", lambda d: None, ("--max-shard-size", "infGB"), ["'infGB'"]),
    ("dtype", lambda d: None, ("--dtype", "int8"), ["dtype='int8'"]),
    ("missing-dir", lambda d: shutil.rmtree(d), (), ["is not a directory"]),
    ("empty-dir", lambda d: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in d.iterdir()], (),
     ["not a megatron-core distributed checkpoint", "metadata.json and .metadata"]),
    ("metadata-json-bad", lambda d: (d / "metadata.json").write_text("{bad"), (), ["metadata.json", "not valid JSON"]),
    ("metadata-json-backend", lambda d: _edit_json(d / "metadata.json", sharded_backend="zarr"), (),
     ["sharded_backend='zarr'", "torch_dist"]),
    ("dot-metadata-garbage", lambda d: (d / ".metadata").write_bytes(b"garbage"), (),
     [".metadata' cannot be read", "copy it again"]),
    ("distcp-truncated", lambda d: _truncate(d / "__0_0.distcp", 5000), (), ["__0_0.distcp' is truncated"]),
    ("distcp-missing", lambda d: (d / "__0_0.distcp").unlink(), (), ["__0_0.distcp", "missing"]),
    ("info-not-object", lambda d: _spoil_info(d, [1]), (), ["agentrl_checkpoint.json", "JSON object"]),
    ("info-lacking", lambda d: _spoil_info(d, {"model_type": "qwen2"}), (),
     ["agentrl_checkpoint.json' lacks architecture", "--hf-config"]),
    ("no-hf-config", lambda d: shutil.rmtree(d / "hf"), (), ["carries no Hugging Face config", "--hf-config"]),
    ("hf-config-list", lambda d: (d / "hf" / "config.json").write_text("[]"), (), ["hf/config.json", "JSON object"]),
]


# every case of both directions: (direction, id, spoil, extra options, what the message names)
BAD_INPUTS = [("hf-to-megatron", *c) for c in HF_CASES] + [("megatron-to-hf", *c) for c in MG_CASES]


@pytest.mark.parametrize("direction,spoil,extra,needles", [(c[0], *c[2:]) for c in BAD_INPUTS],
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_INPUTS])
def test_bad_input(direction: str, spoil: Callable[[Path], object], extra: tuple[str, ...], needles: list[str],
                   ckpts: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged or wrong input checkpoint (HF for hf-to-megatron, megatron for megatron-to-hf), or a bad option:
    exit 2, one line, no output directory."""
    hf_in = direction == "hf-to-megatron"
    src = tmp_path / ("hf" if hf_in else "mg")
    shutil.copytree(ckpts[0] if hf_in else ckpts[1], src)
    spoil(src)
    _fails((_h2m if hf_in else _m2h)(src, tmp_path / "out", *extra), tmp_path / "out", needles, capsys)


def test_hf_checkpoint_given_as_megatron_input(ckpts: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _fails(_m2h(ckpts[0], tmp_path / "out"), tmp_path / "out", [str(ckpts[0]), "use hf-to-megatron"], capsys)


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_bad_output_dir(direction: str, ckpts: tuple[Path, Path], tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    """--out-dir an existing file, under a file, a non-empty directory without --overwrite, or the input
    checkpoint itself (with --overwrite): refused, untouched."""
    src = ckpts[0] if direction == "hf-to-megatron" else ckpts[1]

    def argv(out: Path, *extra: str) -> list[str]:
        return (_h2m if direction == "hf-to-megatron" else _m2h)(src, out, *extra)

    (tmp_path / "afile").write_text("keep me")
    _fails(argv(tmp_path / "afile"), tmp_path / "afile", ["afile' exists and is not a directory"], capsys)
    _fails(argv(tmp_path / "afile" / "sub"), tmp_path / "afile", ["afile' is a file, not a directory"], capsys)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    _fails(argv(tmp_path / "full"), tmp_path / "full", ["full' is not empty", "--overwrite"], capsys)
    _fails(argv(src, "--overwrite"), src, [f"'{src}' is the input checkpoint"], capsys)


def test_output_parent_not_writable(ckpts: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An --out-dir whose parent cannot be written is refused before anything is read or written."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    try:
        _fails(_h2m(ckpts[0], locked / "a" / "out"), locked, [f"'{locked}' is not writable"], capsys)
        _fails(_m2h(ckpts[1], locked / "out"), locked, [f"'{locked}' is not writable"], capsys)
    finally:
        locked.chmod(0o755)


# ------------------------------------------------------------------- failures while writing
def test_failure_while_writing_removes_everything(ckpts: tuple[Path, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A disk that fills up in the middle of hf-to-megatron: exit 2 naming the error, and neither the
    output directory nor the parents it created nor the temporary directory remain."""
    from megatron_agentrl.convert import hf_to_megatron

    real = hf_to_megatron._ChunkProducer.__call__
    calls = []

    def full_disk(self, key, offsets, sizes):
        calls.append(key)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "new" / "x"))
        return real(self, key, offsets, sizes)

    monkeypatch.setattr(hf_to_megatron._ChunkProducer, "__call__", full_disk)
    out = tmp_path / "new" / "deeper" / "out"
    _fails(_h2m(ckpts[0], out), tmp_path / "new", ["No space left on device", str(out)], capsys)
    assert len(calls) == 3 and not (tmp_path / "new").exists()


def test_interrupt_while_writing_removes_everything(ckpts: tuple[Path, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of either conversion: the output is as before (absent, or the old one with
    --overwrite), no temporary directory; the CLI exits 130."""
    from megatron_agentrl.convert import hf_to_megatron
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf
    from megatron_agentrl.convert.safetensors_io import SafetensorsShardWriter

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_to_megatron._ChunkProducer, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_to_megatron.convert_hf_to_megatron(ckpts[0], tmp_path / "mg", progress=False)
    assert main(_h2m(ckpts[0], tmp_path / "mg")) == 130
    assert not (tmp_path / "mg").exists() and _temp_dirs(tmp_path) == []

    old = convert_megatron_to_hf(ckpts[1], tmp_path / "back", progress=False)
    (old / "notes.txt").write_text("mine")
    before = _snapshot(old)
    real_write = SafetensorsShardWriter.write

    def write_then_interrupt(self, name, tensor):
        real_write(self, name, tensor)
        raise KeyboardInterrupt

    monkeypatch.setattr(SafetensorsShardWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_megatron_to_hf(ckpts[1], old, max_shard_size="1KB", overwrite=True, progress=False)
    assert _snapshot(old) == before and _temp_dirs(tmp_path) == []


def test_overwrite_replaces_the_weights_and_keeps_other_files(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    """--overwrite onto an earlier output with more shards: the old shards go, other files stay."""
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    out = convert_megatron_to_hf(ckpts[1], tmp_path / "back", max_shard_size="20KB", progress=False)
    n_before = len(list(out.glob("*.safetensors")))
    (out / "notes.txt").write_text("mine")
    convert_megatron_to_hf(ckpts[1], out, overwrite=True, progress=False)
    assert len(list(out.glob("*.safetensors"))) == 1 < n_before
    assert (out / "notes.txt").read_text() == "mine" and _temp_dirs(tmp_path) == []
    assert read_safetensors_dir(out).keys() == read_safetensors_dir(ckpts[0]).keys()


def test_symlinked_output_dir_is_written_through(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    """An --out-dir that is a link to an empty directory elsewhere: the output lands there, the link stays."""
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    (tmp_path / "storage" / "real").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "storage" / "real")
    convert_megatron_to_hf(ckpts[1], tmp_path / "link", progress=False)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "storage" / "real" / "config.json").is_file()
    assert _temp_dirs(tmp_path) == [] and _temp_dirs(tmp_path / "storage") == []


def test_temp_dir_of_a_dead_run_is_removed(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    """The temporary directory of an earlier run whose process is gone neither blocks a new run nor stays;
    that of a live process is left alone. The checkpoint's metadata names the destination, not the temp dir."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_agentrl.convert.output_dir import _host

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".mg.tmp-{_host()}-{dead.pid}"
    live = tmp_path / f".mg.tmp-{_host()}-{os.getppid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"half")
    out = convert_hf_to_megatron(ckpts[0], tmp_path / "mg", progress=False)
    assert not stale.exists() and live.exists()
    assert FileSystemReader(str(out)).read_metadata().storage_meta.checkpoint_id == out


# ------------------------------------------------------------------------------ subprocesses
def test_cli_subprocesses(ckpts: tuple[Path, Path], tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    """As commands (the real exit status and stderr): ``agentrl convert`` and ``tools/convert_*.py`` on bad
    inputs exit 2 with one line on stderr; SIGTERM in the middle of a conversion exits 130 leaving nothing."""
    agentrl = [str(Path(sys.executable).with_name("agentrl"))]
    if not Path(agentrl[0]).is_file():
        agentrl = [sys.executable, "-m", "megatron_agentrl.cli"]
    trunc = tmp_path / "trunc"
    shutil.copytree(ckpts[0], trunc)
    _truncate(trunc / SHARD3, 1000)
    (tmp_path / "afile").write_text("keep me")
    hf_args, mg_args = _h2m(ckpts[0], tmp_path / "o2")[2:], _m2h(ckpts[1], tmp_path / "afile")[2:]
    cases = [  # command, the output that must not appear (or stay as it is), what the line names
        ([*agentrl, *_h2m(trunc, tmp_path / "o1")], tmp_path / "o1",
         f"agentrl: error: '{trunc / SHARD3}' is truncated"),
        ([*agentrl, *_m2h(ckpts[1], tmp_path / "o3", "--max-shard-size", "0")], tmp_path / "o3",
         "agentrl: error: max_shard_size / --max-shard-size '0' is not a positive byte count"),
        ([sys.executable, "tools/convert_hf_to_megatron.py", *hf_args, "--make-vocab-size-divisible-by", "0"],
         tmp_path / "o2", "convert_hf_to_megatron: error: make_vocab_size_divisible_by=0"),
        ([sys.executable, "tools/convert_megatron_to_hf.py", *mg_args], tmp_path / "afile",
         "convert_megatron_to_hf: error: output directory"),
    ]
    # a conversion that stops in its first chunk until SIGTERM comes
    ready = tmp_path / "ready"
    slow = ("import sys, time; from pathlib import Path; from megatron_agentrl.cli import main; "
            "from megatron_agentrl.convert import hf_to_megatron as h; "
            f"h._ChunkProducer.__call__ = lambda *a: (Path({str(ready)!r}).touch(), time.sleep(60)); "
            f"sys.exit(main({_h2m(ckpts[0], tmp_path / 'o4')!r}))")
    before = {out: _snapshot(out) for _, out, _ in cases}
    for cmd, _, _ in cases:
        processes.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    processes.append(subprocess.Popen([sys.executable, "-c", slow], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    for p, (cmd, out, needle) in zip(processes, cases):
        _, err = p.communicate(timeout=120)
        lines = err.decode().strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), (cmd, p.returncode, lines)
        assert _snapshot(out) == before[out]
    deadline = time.monotonic() + 120
    while not ready.exists() and processes[-1].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), processes[-1].communicate()[1].decode()[-2000:]
    processes[-1].send_signal(signal.SIGTERM)
    _, err = processes[-1].communicate(timeout=60)
    assert processes[-1].returncode == 130, err.decode()[-2000:]
    assert "interrupted" in err.decode() and "Traceback" not in err.decode()
    assert not (tmp_path / "o4").exists() and _temp_dirs(tmp_path) == []
