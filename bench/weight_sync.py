"""Weight-sync bandwidth: the bucketed sync of a ~500M-parameter model vs one raw broadcast, on one gloo group.

Two processes on this machine: the *trainer* (this process) holds the model's Hugging Face state
dict (Qwen2.5-0.5B shapes, bf16, 494M parameters, ~0.99 GB); the *engine* process runs the SGLang
stand-in over a local engine of the same architecture. Both join one weight-sync group (gloo over
loopback). Measured side by side, interleaved, in one run on that one group:

* **bucketed, broadcast** (the headline): ``BucketBroadcaster.send`` with SGLang's transport
  (``SGLangBroadcast``: one broadcast per wire tensor, what an SGLang server receives) and the gloo
  defaults (wire format ``per_tensor``: one message per matrix straight from its memory, tensors under
  the transport's ``small_tensor_bytes`` packed into buckets of their own; buckets of ``--bucket-mb``):
  per bucket an HTTP ``/update_weights_from_distributed`` request on the engine's ordered request
  channel, the transfers, and on the engine the load into the model's parameters (received in place
  while paused, packed ones copied in); timed until the engine acknowledged the last bucket;
* **bucketed** (beside it): the same with the stand-in's transport (``StandInTransport``: every tensor
  of a bucket a point-to-point send, all posted at once), which real SGLang does not offer;
* **raw**: one broadcast of a flat, preallocated buffer of the same number of bytes (the
  stand-in's ``/agentrl/raw_broadcast`` extension receives it into a preallocated buffer);
  timed the same way, until the engine acknowledged.

Runs are interleaved (``--repeats`` rounds after one warm-up of each, the order rotating; 21 by
default: with 7 the best raw time alone moved by 0.19-0.30 s between runs on the 2-core VM, with
21 it held at 0.211 s). Bandwidth = bytes / best run's seconds (on a shared machine, noise only
ever adds time); the median of the per-round ratios is printed beside it. The engine is paused
around each bucketed sync, as the version pool does; those two calls are outside the timed
region. The CPU seconds each path costs the trainer and the engine process are printed beside
the times (on a loaded host they show what the wall time hides). At the end the engine's
weights are zeroed and one more default sync must restore every tensor.
Prints a table and the best run's per-bucket timeline of each bucketed path (taken, packed, posted,
rank 0's wire done, acknowledged), writes ``bench/results/weight_sync.json`` (``--out``) and ends with
``weight_sync_bandwidth_ratio: <SGLang's broadcast transport / raw bandwidth>``. ``--smoke``: a tiny
model (2 layers, hidden 64, vocab 1024), 256 KiB buckets and 2 rounds, in seconds (checks that the
paths run and the weights arrive; the ratio means nothing then).

Usage: ``python bench/weight_sync.py [--bucket-mb 512] [--repeats 21] [--layers 24] [--small-mb M] [--smoke]
[--out PATH]``
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

logger = logging.getLogger("bench.weight_sync")


def qwen25_05b_config(layers: int, smoke: bool = False):
    """Qwen2.5-0.5B's shapes (hidden 896, 14/2 heads, MLP 4864, vocab 151936, tied), ``layers`` deep;
    ``smoke``: the same layout at hidden 64, 4/2 heads, MLP 256, vocab 1024."""
    from transformers import Qwen2Config

    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if smoke:
        return Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           tie_word_embeddings=True, rope_parameters=rope)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_parameters=rope)


def build_uninitialised(cfg, dtype: torch.dtype):
    """The model with allocated, untouched-by-init parameters (the sync overwrites every one)."""
    from transformers import Qwen2ForCausalLM

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device="cpu").eval()
    model.tie_weights()
    return model


def engine_main(conn, layers: int, smoke: bool) -> None:
    """The engine process: a stand-in server over a local engine; answers 'check' and 'stop' on ``conn``."""
    logging.basicConfig(level=logging.WARNING, format="%(created).3f %(name)s %(message)s")
    if os.environ.get("AGENTRL_BENCH_TRACE"):
        logging.getLogger("rollout_sglang.testing.sglang_standin").setLevel(logging.DEBUG)
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.testing.sglang_standin import StandInServer
    from rollout_sglang.testing.standin_options import StandInOptions

    cfg = qwen25_05b_config(layers, smoke)
    model = build_uninitialised(cfg, torch.bfloat16)
    for p in model.parameters():  # touch the pages once, as a loaded engine's weights are
        p.data.zero_()
    engine = LocalEngine(model, dtype="bfloat16", device="cpu")
    server = StandInServer(engine, StandInOptions(group_timeout_s=600))
    conn.send(server.start())
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "zero":  # forget the synced weights, so that the next check sees one sync alone
            for p in model.parameters():
                p.data.zero_()
            conn.send("zeroed")
        if msg == "check":  # per-tensor sums, to verify the last sync landed
            sd = engine.model.state_dict()
            conn.send({k: float(v.float().sum()) for k, v in sd.items() if k != "lm_head.weight"})
    server.stop()


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 10 s in which some runnable task waited for a CPU (None if unavailable)."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(first.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (None: this one), all threads."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_state(cfg) -> dict[str, torch.Tensor]:
    """The trainer's HF state dict (bf16), each tensor filled with its own non-zero constant, exact in bf16
    (cheap, and checkable after the engine's weights were zeroed)."""
    model = build_uninitialised(cfg, torch.bfloat16)
    state = {}
    for i, (k, v) in enumerate(model.state_dict().items()):
        if k == "lm_head.weight":  # tied to the embedding: the trainer does not send it
            continue
        state[k] = v.detach().clone().fill_((2 * (i % 97) - 97) / 128.0)
    return state


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result dict (also written to bench/results/weight_sync.json)."""
    ap = bench_parser("weight_sync", __doc__)
    ap.add_argument("--bucket-mb", type=float, default=512.0, help="bucket size, MiB (rollout.weight_sync_bucket_mb)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--wire-format", default=None, choices=["flattened_bucket", "per_tensor"],
                    help="how a bucket travels (default: the gloo default, per_tensor)")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B, 494M parameters)")
    ap.add_argument("--small-mb", type=float, default=None,
                    help="per_tensor: tensors under this many MiB travel packed (default: each transport's "
                         "small_tensor_bytes)")
    # smoke: a tiny model (2 layers), 256 KiB buckets, 2 rounds: seconds on a CPU
    args = parse_bench_args(ap, argv, {"layers": 2, "bucket_mb": 0.25, "repeats": 2})
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    from rollout_sglang.engines.sglang_client import SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangClientOptions
    from rollout_sglang.testing.transport import StandInTransport
    from rollout_sglang.weight_update import BroadcastOptions, BucketBroadcaster, SGLangBroadcast

    cfg = qwen25_05b_config(args.layers, args.smoke)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(child, args.layers, args.smoke), daemon=True)
    proc.start()
    t0 = time.perf_counter()
    state = make_state(cfg)
    params = sum(v.numel() for v in state.values())
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    deadline = time.monotonic() + 600
    while not parent.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the engine process exited with code {proc.exitcode} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError("the engine process did not start serving within 600 s")
    url = parent.recv()
    sizes = " (smoke sizes)" if args.smoke else ""
    print(f"model: Qwen2 {args.layers} layers{sizes}, {params / 1e6:.3g}M parameters, {nbytes / 1e9:.3g} GB bf16 "
          f"(setup {time.perf_counter() - t0:.1f}s); engine at {url}")

    client = SGLangEngine(url, SGLangClientOptions(update_timeout_s=600, control_timeout_s=60))
    small = None if args.small_mb is None else int(args.small_mb * 1024 * 1024)
    sglang_transport = SGLangBroadcast()
    sender = BucketBroadcaster([client], "bench", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=120, weight_sync_bucket_timeout_s=600, small_tensor_bytes=small),
                               transport=StandInTransport())
    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.fill_(7)
    pool = ThreadPoolExecutor(max_workers=2)
    bucket_bytes = int(args.bucket_mb * 1024 * 1024)
    version = [0]

    def bucketed(transport: SGLangBroadcast | None = None) -> int:
        stats = sender.send(state.items(), bucket_bytes, wire_format=args.wire_format, transport=transport)
        assert stats.bytes == nbytes, (stats.bytes, nbytes)
        return stats.buckets

    def update(fn) -> int:
        """One weight update as the version pool runs it: paused, inside the server's update session."""
        version[0] += 1
        client.pause()
        client.begin_weight_update(version[0])
        try:
            return fn()
        finally:
            client.end_weight_update()
            client.resume()

    update(bucketed)  # the group forms inside the first update (as SGLang's engines join it)
    group = sender.group
    assert group is not None

    def raw() -> int:
        body = {"nbytes": nbytes, "group_name": sender.group_name}
        fut = pool.submit(httpx.post, f"{url}/agentrl/raw_broadcast", json=body, timeout=600)
        group.broadcast(flat, src=0, timeout_s=600)
        fut.result(timeout=600).raise_for_status()
        return 1

    # (label, run, is a weight update): the version pool pauses the slot and opens the server's update
    # session around a sync; those calls are outside the timed region
    paths = {"raw": ("raw broadcast (1 flat buffer)", raw, False),
             "bucketed": (f"bucketed sync ({args.bucket_mb:g} MiB, {sender.transport.name})", bucketed, True),
             # what an SGLang server receives
             "bucketed_broadcast": (f"bucketed sync ({args.bucket_mb:g} MiB, {sglang_transport.name})",
                                    lambda: bucketed(sglang_transport), True)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
    buckets: dict[str, int] = {}

    timelines: dict[str, list[dict[str, float]]] = {}

    def timed(key: str) -> None:
        _, fn, is_update = paths[key]

        def run() -> int:
            c0, e0 = process_cpu_s(), process_cpu_s(proc.pid)
            t = time.perf_counter()
            n = fn()
            times[key].append(time.perf_counter() - t)
            if key != "raw" and times[key][-1] <= min(times[key]):  # the best run's per-bucket timeline
                timelines[key] = [dict(m) for m in sender.timeline]
            cpu[key].append((process_cpu_s() - c0, process_cpu_s(proc.pid) - e0))
            return n

        buckets[key] = update(run) if is_update else run()

    psi0 = cpu_pressure()
    for key in paths:  # warm-up: connections, receive buffers
        timed(key)
    times = {k: [] for k in paths}
    cpu = {k: [] for k in paths}
    keys = list(paths)
    for r in range(args.repeats):  # interleaved rounds, rotating which path goes first
        for i in range(len(keys)):
            timed(keys[(r + i) % len(keys)])
    psi1 = cpu_pressure()
    # verify the default path alone: zero the engine's weights, sync once more, compare
    parent.send("zero")
    parent.recv()
    update(bucketed)
    parent.send("check")
    sums = parent.recv()
    bad = [k for k, v in state.items() if abs(sums[k] - float(v.float().sum())) > 1e-3 * max(1.0, abs(sums[k]))]
    sender.close()
    parent.send("stop")
    proc.join(30)
    pool.shutdown()

    # bandwidth of each path from its best run (noise on a shared machine only ever adds time);
    # the median of the per-round ratios is reported beside it
    best = {k: min(v) for k, v in times.items()}
    bw = {k: nbytes / best[k] / 1e9 for k in paths}
    ratio = bw["bucketed_broadcast"] / bw["raw"]  # the headline: what an SGLang server receives
    pair_ratio = {k: statistics.median(r / b for r, b in zip(times["raw"], times[k])) for k in paths if k != "raw"}
    print(f"\n{'path':<40} {'buckets':>7} {'best s':>7} {'median s':>9} {'GB/s':>6}   runs (s)")
    for k, (label, _, _) in paths.items():
        print(f"{label:<40} {buckets[k]:>7} {best[k]:>7.3f} {statistics.median(times[k]):>9.3f} {bw[k]:>6.2f}   "
              + ", ".join(f"{x:.3f}" for x in times[k]))
    med_cpu = {k: (statistics.median(c[0] for c in v), statistics.median(c[1] for c in v)) for k, v in cpu.items()}
    print("CPU seconds per run (median; trainer, engine): " + "; ".join(
        f"{k} {a:.3f}, {b:.3f}" for k, (a, b) in med_cpu.items()))
    print("bandwidth ratio to raw (best runs): " + ", ".join(f"{k} {bw[k] / bw['raw']:.3f}" for k in pair_ratio)
          + "; median of per-round ratios (raw s / path s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in pair_ratio.items()))
    for k, rows in timelines.items():
        print(f"timeline of the best {paths[k][0]} (ms from its start; taken, packed, requested+posted, rank 0's "
              "wire done, every engine acknowledged):")
        for i, m in enumerate(rows):
            print(f"  bucket {i}: {m['mb']:7.1f} MB {m['tensors']:4.0f} tensors | " + " ".join(
                f"{f} {1e3 * m[f]:7.1f}" for f in ("taken", "packed", "posted", "wire_done", "acked") if f in m))
    print(f"load average {os.getloadavg()[0]:.1f}, CPU pressure (PSI some avg10) {psi0}% before, {psi1}% after")
    print(f"weights verified on the engine: {'yes' if not bad else 'NO, mismatched: ' + ', '.join(bad[:5])}")
    result = {
        "bench": "weight_sync", "model": f"qwen2.5-0.5b shapes, {args.layers} layers", "parameters": params,
        "bytes": nbytes, "dtype": "bfloat16", "backend": "gloo (loopback, 2 processes)",
        "bucket_mb": args.bucket_mb, "buckets": buckets, "repeats": args.repeats,
        "wire_format": args.wire_format or "per_tensor (gloo default)", "transport": sender.transport.name,
        "seconds": times, "gb_per_s_best": bw, "ratio_to_raw_best": {k: bw[k] / bw["raw"] for k in pair_ratio},
        "weight_sync_bandwidth_ratio": ratio, "standin_transport_ratio": bw["bucketed"] / bw["raw"],
        "median_round_ratio": pair_ratio, "weights_verified": not bad, "timelines_best_s": timelines,
        "cpu_s_median_trainer_engine": med_cpu, "smoke": args.smoke,
        "small_tensor_bytes": small or {t.name: t.small_tensor_bytes for t in (sender.transport, sglang_transport)},
        "load_average_1m": os.getloadavg()[0],
        "cpu_pressure_some_avg10_pct_before": psi0, "cpu_pressure_some_avg10_pct_after": psi1,
        "host": {"cpus": mp.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = write_record(args.out, result)
    print(f"results: {out}")
    print(f"stand-in transport (point-to-point, not SGLang's API): {bw['bucketed'] / bw['raw']:.3f}")
    print(f"weight_sync_bandwidth_ratio: {ratio:.3f}")
    if bad:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
