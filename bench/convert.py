"""Benchmark: streaming weight conversion of a ~1.5B-parameter Qwen2 checkpoint, peak memory and time.

Writes a random checkpoint with the shapes of Qwen2.5-1.5B (28 layers, hidden 1536, FFN 8960,
12 heads / 2 KV heads, vocab 151936, tied embeddings: 1.54 B parameters) in bfloat16, the dtype
such checkpoints are published in (3.1 GB of safetensors in two shards with an index, written
tensor by tensor with the streaming writer, so the bench itself never holds the model either).
Then it converts it HF -> megatron distributed checkpoint (``--tp``, default 1: the whole
embedding is one chunk, the worst case for memory) and back megatron -> HF, each direction in a
fresh child process, and checks that the round trip is bit-identical (streamed, tensor by
tensor).

Peak RSS of a child is its ``VmHWM`` (/proc/self/status). Two baselines are subtracted and both
are reported: the bare interpreter (``python`` started, nothing imported) and the interpreter
with the conversion code imported (torch, transformers). The headline
``convert_peak_rss_gb`` is the larger of the two directions above the *bare* interpreter (so
it includes the imports) -- the conservative reading of "above the interpreter's baseline".

    .venv/bin/python bench/convert.py            # bf16, tp=1; ~3.1 GB x 3 written to a temp dir
    .venv/bin/python bench/convert.py --tp 2 --dtype float32 --keep
    .venv/bin/python bench/convert.py --smoke --out /tmp/convert.json

Prints a table, writes ``bench/results/convert.json`` (``--out``), removes the written checkpoints
(unless ``--keep``); the last line is ``convert_peak_rss_gb: <value>``. ``--smoke``: the same
steps on a tiny Qwen2-shaped model (``--model tiny``: 2 layers, hidden 64, vocab 512, float32, shards
of 100 kB), in seconds; its memory figure is mostly the imports.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, parse_bench_args, write_record  # noqa: E402  (only the standard library)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


# The bare interpreter: only the standard library modules above are loaded.
_BARE_KB = _status_kb("VmRSS")

_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=_ROPE),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_parameters=_ROPE),
}
SMOKE = {"model": "tiny", "dtype": "float32", "max_shard_size": "100kB"}


# ------------------------------------------------------------------------------------- child
def child(direction: str, src: str, dst: str, tp: int, bare_kb: int) -> None:
    """Run one conversion in this fresh process and print a JSON line with its memory and time."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers  # noqa: F401  (the conversion imports torch and transformers)

    from megatron_agentrl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_agentrl.convert.megatron_to_hf import convert_megatron_to_hf

    import_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if direction == "hf2mg":
        convert_hf_to_megatron(src, dst, tp=tp, pp=1, progress=False)
    else:
        convert_megatron_to_hf(src, dst, progress=False)
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    print(json.dumps({"direction": direction, "seconds": seconds, "bare_kb": bare_kb, "import_kb": import_kb,
                      "peak_kb": peak_kb}))


def run_child(direction: str, src: Path, dst: Path, tp: int) -> dict[str, Any]:
    """Run ``child`` in a new interpreter (``bench/convert.py --child ...``)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", direction, str(src), str(dst), str(tp)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{direction} conversion failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------- parent
def write_random_checkpoint(out: Path, shape: dict[str, Any], dtype: Any,
                            max_shard_size: str) -> tuple[int, int, float]:
    """Write a random Qwen2 checkpoint of ``shape`` (Qwen2Config fields): config.json, tokenizer
    files, shards + index, one tensor at a time. Returns (parameters, bytes, seconds)."""
    import torch
    from transformers import Qwen2Config

    from megatron_agentrl.convert.qwen2 import Qwen2Mapping
    from megatron_agentrl.convert.safetensors_io import SafetensorsShardWriter, dtype_size, parse_size

    t0 = time.perf_counter()
    cfg = Qwen2Config(**shape)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.dtype = str(dtype).removeprefix("torch.")
    out.mkdir(parents=True)
    cfg.save_pretrained(str(out))
    tok = REPO / "examples" / "tokenizer" / "tiny_agent"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tok / f).is_file():
            shutil.copyfile(tok / f, out / f)
    mapping = Qwen2Mapping(cfg)
    plan = []
    for mname in mapping.megatron_names():
        for name, shape in mapping.hf_shapes(mname).items():
            plan.append((name, shape, dtype))
    writer = SafetensorsShardWriter(out, plan, parse_size(max_shard_size))
    gen = torch.Generator().manual_seed(0)
    n_params = 0
    for name, shape, _ in plan:
        if name.endswith("norm.weight"):
            t = (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(dtype)
        else:
            t = (0.02 * torch.randn(shape, generator=gen)).to(dtype)
        writer.write(name, t)
        n_params += t.numel()
        del t
    writer.close()
    return n_params, n_params * dtype_size(dtype), time.perf_counter() - t0


def verify_identical(a: Path, b: Path) -> int:
    """Compare every tensor of two HF directories, one at a time; returns the count (raises on a difference)."""
    import torch

    from megatron_agentrl.convert.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if set(ra.tensors) != set(rb.tensors):
        raise SystemExit(f"tensor names differ: {sorted(set(ra.tensors) ^ set(rb.tensors))[:5]}")
    for name in ra.names():
        x, y = ra.read(name), rb.read(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            raise SystemExit(f"round trip changed tensor {name}")
    return len(ra.tensors)


def main(argv: list[str] | None = None) -> None:
    """The parent: write, convert both ways in child processes, verify, print, write the JSON."""
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), _BARE_KB)
        return
    parser = bench_parser("convert", __doc__)
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=list(MODELS), help="shape of the random model")
    parser.add_argument("--tp", type=int, default=1, help="TP layout of the megatron checkpoint (1: worst-case memory)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-shard-size", default="2GB", help="shard size of the random HF input")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--limit-gb", type=float, default=2.0, help="peak RSS budget above the interpreter")
    args = parse_bench_args(parser, argv, SMOKE)

    import torch

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="agentrl_convert_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    hf, mg, back = work / "hf", work / "megatron", work / "hf_back"
    for d in (hf, mg, back):
        if d.exists():
            shutil.rmtree(d)
    try:
        print(f"writing a random {args.model}-shaped checkpoint ({args.dtype}) to {hf} ...", flush=True)
        n_params, n_bytes, t_write = write_random_checkpoint(hf, MODELS[args.model], dtype, args.max_shard_size)
        print(f"  {n_params / 1e9:.3f} B parameters, {n_bytes / 1e9:.2f} GB in {t_write:.1f} s", flush=True)
        print("converting hf -> megatron ...", flush=True)
        a = run_child("hf2mg", hf, mg, args.tp)
        print("converting megatron -> hf ...", flush=True)
        b = run_child("mg2hf", mg, back, args.tp)
        print("verifying the round trip ...", flush=True)
        t0 = time.perf_counter()
        n_tensors = verify_identical(hf, back)
        t_verify = time.perf_counter() - t0
        mg_bytes = sum(f.stat().st_size for f in mg.glob("*.distcp"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows = []
    for r in (a, b):
        r["peak_above_bare_gb"] = (r["peak_kb"] - r["bare_kb"]) / 2**20
        r["peak_above_imports_gb"] = (r["peak_kb"] - r["import_kb"]) / 2**20
        r["gb_per_s"] = n_bytes / 1e9 / r["seconds"]
        rows.append(r)
    headline = max(r["peak_above_bare_gb"] for r in rows)
    print()
    print(f"{'direction':<16}{'time s':>9}{'GB/s':>8}{'bare GB':>10}{'imports GB':>12}{'peak GB':>10}"
          f"{'peak-bare':>11}{'peak-imports':>14}")
    for r in rows:
        print(f"{r['direction']:<16}{r['seconds']:>9.1f}{r['gb_per_s']:>8.2f}{r['bare_kb'] / 2**20:>10.3f}"
              f"{r['import_kb'] / 2**20:>12.3f}{r['peak_kb'] / 2**20:>10.3f}{r['peak_above_bare_gb']:>11.3f}"
              f"{r['peak_above_imports_gb']:>14.3f}")
    print(f"round trip bit-identical: {n_tensors} tensors ({t_verify:.1f} s); model {n_bytes / 1e9:.2f} GB "
          f"({n_params / 1e9:.3f} B params, {args.dtype}), megatron checkpoint {mg_bytes / 1e9:.2f} GB; "
          f"budget {args.limit_gb} GB: {'OK' if headline < args.limit_gb else 'EXCEEDED'}")
    result = {
        "bench": "convert", "smoke": args.smoke, "model": f"{args.model}-shaped (random)",
        "config": MODELS[args.model], "dtype": args.dtype,
        "tp": args.tp, "params": n_params, "model_bytes": n_bytes, "megatron_bytes": mg_bytes,
        "write_random_s": t_write, "verify_s": t_verify, "roundtrip_identical": True, "tensors": n_tensors,
        "directions": rows, "convert_peak_rss_gb": headline, "limit_gb": args.limit_gb,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 "platform": platform.platform()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"results: {write_record(args.out, result)}")
    print(f"convert_peak_rss_gb: {headline:.3f}")


if __name__ == "__main__":
    main()
