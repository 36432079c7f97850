"""Benchmark: streaming weight conversion of ~1.5B-parameter checkpoints, dense and MoE, peak memory and time.

Writes random checkpoints in bfloat16, the dtype such checkpoints are published in, as safetensors
shards with an index, written tensor by tensor with the streaming writer (so the bench itself never
holds a model either):

* ``qwen2.5-1.5b``: the shapes of Qwen2.5-1.5B (28 layers, hidden 1536, FFN 8960, 12 heads / 2 KV
  heads, vocab 151936, tied embeddings: 1.54 B parameters, 3.1 GB);
* ``qwen3-moe-1.5b``: a Qwen3-MoE (``Qwen3MoeForCausalLM``) with Qwen3's attention (16 heads / 4 KV
  heads of dim 128, q/k norms), 15 layers of hidden 1024, each a MoE layer of 64 experts of width
  384 (top 8) and a router, vocab 151936, untied: 1.52 B parameters (3.0 GB) in 3,018 HF tensors, 2,880
  of them experts' ``gate_proj / up_proj / down_proj``.

Each model is converted HF -> megatron distributed checkpoint (``--tp``, default 1: the whole
embedding is one chunk, the worst case for memory) and back megatron -> HF, each direction in a
fresh child process, and the round trip is checked bit-identical (streamed, tensor by tensor).

Peak RSS of a child is its ``VmHWM`` (/proc/self/status). Two baselines are subtracted and both
are reported: the bare interpreter (``python`` started, nothing imported) and the interpreter
with the conversion code imported (torch, transformers). A model's ``convert_peak_rss_gb`` is the
larger of its two directions above the *bare* interpreter (so it includes the imports) -- the
conservative reading of "above the interpreter's baseline". What the converters hold at once is
reported beside it: megatron -> HF reads one whole decoder layer (with all its experts) at a time,
HF -> megatron one chunk, the largest being the embedding's (``padded_vocab / tp`` rows).

    .venv/bin/python bench/convert.py            # both models, bf16, tp=1; ~3 GB x 3 each, in a temp dir
    .venv/bin/python bench/convert.py --model qwen3-moe-1.5b
    .venv/bin/python bench/convert.py --tp 2 --dtype float32 --keep
    .venv/bin/python bench/convert.py --smoke --out /tmp/convert.json

Prints a table (a row per model and direction), writes ``bench/results/convert.json`` (``--out``),
removes the written checkpoints (unless ``--keep``); the output ends with a
``convert_peak_rss_gb.<model>: <value>`` line per model, then ``convert_peak_rss_gb: <value>``, the
largest of them. ``--smoke``: the same steps on a tiny Qwen2-shaped model and a tiny Qwen3-MoE
(``tiny``, ``tiny-moe``: 2 layers, hidden 64, vocab 512, 4 experts, float32, shards of 100 kB), in
seconds; its memory figures are mostly the imports.
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

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402  (standard library)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


# The bare interpreter: only the standard library modules above are loaded.
_BARE_KB = _status_kb("VmRSS")

_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
# name -> (transformers model_type, config fields)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=_ROPE)),
    "qwen3-moe-1.5b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=15, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384,
        norm_topk_prob=True, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=_ROPE)),
    "tiny": ("qwen2", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=_ROPE)),
    "tiny-moe": ("qwen3_moe", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=_ROPE)),
}
DEFAULT_MODELS = ["qwen2.5-1.5b", "qwen3-moe-1.5b"]
SMOKE = {"model": ["tiny", "tiny-moe"], "dtype": "float32", "max_shard_size": "100kB"}


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
        raise SystemExit(f"{direction} conversion of {src} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------- parent
def make_config(model_type: str, shape: dict[str, Any], dtype: Any) -> tuple[Any, Any]:
    """The transformers config of a ``model_type`` model with the fields ``shape``, and its mapping."""
    from transformers import AutoConfig

    from megatron_agentrl.convert import get_mapping

    cfg = AutoConfig.for_model(model_type, **shape)
    mapping = get_mapping(cfg)
    cfg.architectures = [mapping.architecture]
    cfg.dtype = str(dtype).removeprefix("torch.")
    return cfg, mapping


def write_random_checkpoint(out: Path, model_type: str, shape: dict[str, Any], dtype: Any,
                            max_shard_size: str) -> tuple[int, int, int, float]:
    """Write a random checkpoint of a ``model_type`` family (dense or MoE) with the config fields
    ``shape``: config.json, tokenizer files, shards + index, one tensor at a time (tensors the
    family keeps in fp32, e.g. GLM-4.5's expert bias, in fp32). Returns (parameters, bytes, tensors,
    seconds)."""
    import torch

    from megatron_agentrl.convert.safetensors_io import SafetensorsShardWriter, dtype_size, parse_size

    t0 = time.perf_counter()
    cfg, mapping = make_config(model_type, shape, dtype)
    out.mkdir(parents=True)
    cfg.save_pretrained(str(out))
    tok = REPO / "examples" / "tokenizer" / "tiny_agent"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tok / f).is_file():
            shutil.copyfile(tok / f, out / f)
    plan = []
    for mname in mapping.megatron_names():
        t_dtype = torch.float32 if mapping.keeps_fp32(mname) else dtype
        for name, shape in mapping.hf_shapes(mname).items():
            plan.append((name, shape, t_dtype))
    writer = SafetensorsShardWriter(out, plan, parse_size(max_shard_size))
    gen = torch.Generator().manual_seed(0)
    n_params = n_bytes = 0
    for name, shape, t_dtype in plan:
        if name.endswith("norm.weight"):
            t = (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(t_dtype)
        else:
            t = (0.02 * torch.randn(shape, generator=gen)).to(t_dtype)
        writer.write(name, t)
        n_params += t.numel()
        n_bytes += t.numel() * dtype_size(t_dtype)
        del t
    writer.close()
    return n_params, n_bytes, len(plan), time.perf_counter() - t0


def held_at_once(mapping: Any, dtype: Any, tp: int) -> dict[str, int]:
    """What the converters hold at once, in bytes: the largest decoder layer (megatron -> HF reads a
    whole layer, all its experts included), the largest expert tensor, and the embedding chunk of
    one TP rank (HF -> megatron's largest chunk: ``padded_vocab / tp`` rows)."""
    import math

    from megatron_agentrl.convert.base import EMBEDDING
    from megatron_agentrl.convert.safetensors_io import dtype_size
    from megatron_agentrl.parallel_layout import padded_vocab_size

    size = dtype_size(dtype)
    layers, experts = [], [0]
    for i in range(mapping.num_layers):
        numels = {n: math.prod(mapping.megatron_shape(n)) for n in mapping.layer_megatron_names(i)}
        layers.append(sum(numels.values()))
        experts += [k for n, k in numels.items() if mapping.expert_index(n) is not None]
    vocab_rows = padded_vocab_size(mapping.vocab_size, 128, tp) // tp
    return {"largest_layer_bytes": max(layers) * size, "largest_expert_tensor_bytes": max(experts) * size,
            "embedding_chunk_bytes": vocab_rows * mapping.megatron_shape(EMBEDDING)[1] * size}


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


def bench_model(name: str, work: Path, dtype: Any, args: Any) -> dict[str, Any]:
    """Write model ``name`` under ``work/name``, convert it both ways in child processes, verify the
    round trip; returns its record (the checkpoints are removed unless ``--keep``)."""
    model_type, shape = MODELS[name]
    root = work / name
    hf, mg, back = root / "hf", root / "megatron", root / "hf_back"
    for d in (hf, mg, back):
        if d.exists():
            shutil.rmtree(d)
    try:
        print(f"[{name}] writing a random {model_type} checkpoint ({args.dtype}) to {hf} ...", flush=True)
        n_params, n_bytes, n_written, t_write = write_random_checkpoint(hf, model_type, shape, dtype,
                                                                        args.max_shard_size)
        print(f"  {n_params / 1e9:.3f} B parameters, {n_written} tensors, {n_bytes / 1e9:.2f} GB in {t_write:.1f} s",
              flush=True)
        print(f"[{name}] converting hf -> megatron ...", flush=True)
        a = run_child("hf2mg", hf, mg, args.tp)
        print(f"[{name}] converting megatron -> hf ...", flush=True)
        b = run_child("mg2hf", mg, back, args.tp)
        print(f"[{name}] verifying the round trip ...", flush=True)
        t0 = time.perf_counter()
        n_tensors = verify_identical(hf, back)
        t_verify = time.perf_counter() - t0
        mg_bytes = sum(f.stat().st_size for f in mg.glob("*.distcp"))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    _, mapping = make_config(model_type, shape, dtype)
    rows = []
    for r in (a, b):
        r["peak_above_bare_gb"] = (r["peak_kb"] - r["bare_kb"]) / 2**20
        r["peak_above_imports_gb"] = (r["peak_kb"] - r["import_kb"]) / 2**20
        r["gb_per_s"] = n_bytes / 1e9 / r["seconds"]
        rows.append(r)
    peak = max(r["peak_above_bare_gb"] for r in rows)
    return {
        "model": name, "family": model_type, "moe": mapping.is_moe, "experts": mapping.num_experts,
        "config": shape, "params": n_params, "model_bytes": n_bytes, "megatron_bytes": mg_bytes,
        "write_random_s": t_write, "verify_s": t_verify, "roundtrip_identical": True, "tensors": n_tensors,
        **held_at_once(mapping, dtype, args.tp), "directions": rows, "convert_peak_rss_gb": peak,
        "within_limit": peak < args.limit_gb,
    }


def main(argv: list[str] | None = None) -> None:
    """The parent: for each model write, convert both ways in child processes, verify; print, write the JSON."""
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), _BARE_KB)
        return
    parser = bench_parser("convert", __doc__)
    parser.add_argument("--model", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS),
                        help="shapes of the random models, run in turn (default: the dense and the MoE one)")
    parser.add_argument("--tp", type=int, default=1, help="TP layout of the megatron checkpoint (1: worst-case memory)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-shard-size", default="2GB", help="shard size of the random HF input")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--limit-gb", type=float, default=2.0, help="peak RSS budget above the interpreter")
    args = parse_bench_args(parser, argv, SMOKE)

    import torch

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    made_work = not args.workdir
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="agentrl_convert_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = [bench_model(name, work, dtype, args) for name in dict.fromkeys(args.model)]
    finally:
        if made_work and not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'model':<16}{'direction':<11}{'time s':>8}{'GB/s':>7}{'bare GB':>9}{'imports GB':>12}{'peak GB':>9}"
          f"{'peak-bare':>11}{'peak-imports':>14}")
    for run in runs:
        for r in run["directions"]:
            print(f"{run['model']:<16}{r['direction']:<11}{r['seconds']:>8.1f}{r['gb_per_s']:>7.2f}"
                  f"{r['bare_kb'] / 2**20:>9.3f}{r['import_kb'] / 2**20:>12.3f}{r['peak_kb'] / 2**20:>9.3f}"
                  f"{r['peak_above_bare_gb']:>11.3f}{r['peak_above_imports_gb']:>14.3f}")
    for run in runs:
        kind = f"MoE, {run['experts']} experts/layer" if run["moe"] else "dense"
        print(f"{run['model']}: round trip bit-identical: {run['tensors']} tensors ({run['verify_s']:.1f} s); "
              f"model {run['model_bytes'] / 1e9:.2f} GB ({run['params'] / 1e9:.3f} B params, {args.dtype}, {kind}), "
              f"megatron checkpoint {run['megatron_bytes'] / 1e9:.2f} GB; held at once: largest layer "
              f"{run['largest_layer_bytes'] / 1e9:.3f} GB, embedding chunk "
              f"{run['embedding_chunk_bytes'] / 1e9:.3f} GB; "
              f"budget {args.limit_gb} GB: {'OK' if run['within_limit'] else 'EXCEEDED'}")
    headline = max(run["convert_peak_rss_gb"] for run in runs)
    result = {
        "bench": "convert", "smoke": args.smoke, "models": [run["model"] for run in runs], "dtype": args.dtype,
        "tp": args.tp, "runs": runs, "roundtrip_identical": all(run["roundtrip_identical"] for run in runs),
        "tensors": sum(run["tensors"] for run in runs), "convert_peak_rss_gb": headline, "limit_gb": args.limit_gb,
        "commit": git_commit(),
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                 "platform": platform.platform(), "loadavg": os.getloadavg()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"results: {write_record(args.out, result)}")
    for run in runs:
        print(f"convert_peak_rss_gb.{run['model']}: {run['convert_peak_rss_gb']:.3f}")
    print(f"convert_peak_rss_gb: {headline:.3f}")


if __name__ == "__main__":
    main()
