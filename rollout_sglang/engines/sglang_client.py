"""The SGLang engine: one ``sglang.launch_server`` process per engine, driven over SGLang's HTTP API.

:class:`SGLangEngine` is both an :class:`~rollout_sglang.engines.protocol.Engine` (for the agent loop and
the version pool) and a weight-update target of the trainer's bucketed sync
(:class:`rollout_sglang.weight_update.WeightUpdateTarget`). It maps the protocol onto SGLang's native
endpoints (request/response shapes as documented for SGLang 0.5.x: ``io_struct.py`` and
``entrypoints/http_server.py``):

==========================================  ==================================================
protocol                                    SGLang
==========================================  ==================================================
``generate(prompts, params)``               ``POST /generate`` ``{"input_ids": [[...]], "sampling_params": [{...}],
                                            "return_logprob": true}`` -> per prompt ``output_ids``,
                                            ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``)
                                            and ``meta_info.weight_versions`` (each token's version, below)
``generate(..., seeds)``                    each row's ``sampling_params`` carries its own ``sampling_seed``
``generate(..., routing_from)`` (MoE)       one ``/generate`` per distinct start (SGLang takes one start per
                                            request), adding ``"return_routed_experts": true,
                                            "routed_experts_start_len": start`` -> ``meta_info.routed_experts``
                                            (base64 of int32 ``[positions, num_hidden_layers, top_k]``,
                                            positions ``[start, seqlen - 1)``; the server needs
                                            ``--enable-return-routed-experts``); the MoE layers are kept
``score(sequences, starts)``                ``POST /generate`` ``{"input_ids": [[...]], "sampling_params":
                                            [{"max_new_tokens": 0}], "return_logprob": true, "logprob_start_len":
                                            [max(start - 1, 0)]}`` -> per sequence
                                            ``meta_info.input_token_logprobs`` (below)
``pause()`` (drained)                       ``POST /pause_generation {"mode": options.pause_mode}`` ('abort' by
                                            default: the version pool drained the engine, nothing is running)
``pause("in_place")``                       ``POST /pause_generation {"mode": "in_place"}``: SGLang's scheduler
                                            stops between two batches and keeps each running request in its
                                            running batch, KV cache and all; after the update a request continues
                                            over KV the old weights computed (cheap, slightly off-policy)
``pause("retract")``                        ``POST /pause_generation {"mode": "retract"}``: the running requests go
                                            back to the waiting queue and free their KV; after
                                            ``/continue_generation`` each is prefilled again (prompt and tokens so
                                            far) with the new weights (exact, one recompute per request)
``resume()``                                ``POST /continue_generation {}``
``begin_weight_update(version)``            ``POST /begin_weight_update {}`` (opens the server's weight-update session;
                                            the client keeps ``version``)
``init_weights_update_group(...)``          ``POST /init_weights_update_group {master_address, master_port,
                                            rank_offset, world_size, group_name, backend}``
``update_weights_from_distributed(...)``    ``POST /update_weights_from_distributed {names, dtypes, shapes,
                                            group_name, flush_cache, weight_version, load_format}`` (only
                                            inside a session: SGLang refuses it otherwise; ``weight_version``
                                            on the last bucket only: the open update's version); in an
                                            ``in_place`` pause always ``flush_cache: false``
``end_weight_update()``                     ``POST /end_weight_update {}``, ``POST /flush_cache`` (prefix cache
                                            built with old weights), version stamp; in an ``in_place`` pause no
                                            flush (see below)
``abort_weight_update()``                   ``POST /end_weight_update {}`` (the session closed, no stamp)
``health()``                                ``GET /health`` (+ ``GET /model_info`` for ``weight_version``); the
                                            pause mode and whether a flush is owed come from the client
``probe(timeout_s)``                        ``GET /health_generate`` (+ ``GET /model_info``), the pool's health check
``num_ranks``                               ``GET /server_info`` ``tp_size`` (unless given)
``load_adapter(adapter)`` (LoRA)            ``POST /load_lora_adapter {lora_name, lora_path, pinned}``: the server
                                            reads the adapter's PEFT directory (``adapter.path``) itself
``unload_adapter(name)``                    ``POST /unload_lora_adapter {lora_name}``
``generate(..., adapters)``                 ``"lora_path": [name or null per prompt]`` on ``/generate`` (SGLang's
                                            ``lora_path`` names a loaded adapter by its ``lora_name``)
==========================================  ==================================================

Every call has a timeout (``request_timeout_s`` for generation, ``control_timeout_s`` for
pause/continue/flush/health, the caller's for weight updates) and raises :class:`SGLangError`
naming the endpoint, the server and the fix; when the server could not serve (unreachable, a 5xx
answer, an aborted request, :class:`SGLangTimeout`) it is an :class:`SGLangUnavailable`, which the
version pool answers by routing the request to another engine.

Each generated token's version: SGLang 0.5.23 answers every finished request with
``meta_info.weight_versions = [{"version", "start", "end"}, ...]``, spans over output token positions. Its
scheduler records, when an update carrying ``weight_version`` lands (``record_weight_version_change``), how many
tokens each live request had, and the spans say which version sampled each token
(``srt/utils/weight_versions.py``); ``meta_info.weight_version`` is the last span's. A request that an in-flight
update crossed has two spans, the old version's then the new one's. A span whose version is not one of ours (a
fresh server's ``"default"``), or an answer without spans (an older SGLang), gives its tokens the client's stamp
as the call started (set by :meth:`end_weight_update` after a successful sync); an output's ``version`` is its
last token's. Spans that do not cover the tokens exactly once each, in order, with integer bounds, are
hostile input: :class:`SGLangUnavailable` naming the server and what is wrong.

Scoring (:meth:`SGLangEngine.score`) reads SGLang 0.5.23's input log-probs. With ``logprob_start_len`` L >= 0
the scheduler keeps L (``Scheduler._handle_generate_request``, ``srt/managers/scheduler.py``: L > len(input)
aborts the request; -1, the default, means output tokens only, no input log-probs), and the prefix cache matches
at most L tokens (``Req._compute_max_prefix_len``, ``schedule_batch.py``). The logits processor keeps the hidden
states of positions ``[L, len)`` (``LogitsProcessor._get_pruned_states``, ``srt/layers/logits_processor.py``) and
gathers, at position p, token p + 1 (``extend_input_logprob_token_ids``, ``ScheduleBatch.prepare_for_extend``)
from ``log_softmax`` of the raw logits, with no temperature (``InputLogprobProcessor._forward_by_chunk``,
``srt/layers/logprob_processor.py``). The scheduler then drops the last (the next token's) and puts None first
(``SchedulerLogprobResultProcessor._process_input_token_logprobs``,
``scheduler_components/logprob_result_processor.py``): entry k of ``meta_info.input_token_logprobs`` is
``[logprob, token_id, null]`` of input position L + k, and entry 0's log-prob (position L itself) is None: its
logits would come from position L - 1, which is not computed. So the client asks from ``max(start - 1, 0)`` to
score the positions from ``start`` on. The token id reported for an id ``>= vocab_size - 1`` is 0 (the same
function clips it); the client checks the others against the ids it sent.

The flush after an update, by pause mode. SGLang's scheduler flushes only when it is idle
(``is_fully_idle(ignore_waiting=paused)``), and its weight updater fails an update whose ``flush_cache`` it could
not honour (``flush_cache_after_weight_update``, scheduler_components/weight_updater.py). A drained pause
('abort') leaves nothing running, and a ``retract`` pause leaves the held requests in the waiting queue, which
a paused scheduler ignores: both flush after the update. An ``in_place`` pause keeps the held requests in the
running batch, so the buckets go with ``flush_cache: false`` and :meth:`end_weight_update` does not call
``/flush_cache`` (it would be refused). The prefix (radix) cache then keeps KV computed with the old weights,
which later requests that share a prefix reuse, until it is evicted or flushed: :meth:`flush_if_stale` flushes it
when the server is idle (the version pool's health checks call it; ``health()["stale_prefix_cache"]`` says a flush
is owed; the next drained update's flush clears it too).

Versions are ``int`` in our packages; SGLang's ``weight_version`` is a string. This client is the
one place that converts (:func:`version_to_wire`, :func:`version_from_wire`): the version an update
was opened for goes to the server as a string with the update's last bucket, and a version the
server reports comes back as an int (None when it is not one of ours, e.g. SGLang's ``"default"``).

LoRA runs (docs/rollout.md, "Versions as adapters"): the server is launched with the LoRA flags
(:class:`~rollout_sglang.engines.sglang_options.LoraServerFlags`); each live weight version is an adapter
named ``v<version>``, loaded from a directory the server can read (a shared filesystem on a cluster). The
client remembers each loaded adapter's version, and an output generated with an adapter carries it. SGLang's
from-tensors route (``/load_lora_adapter_from_tensors``) is not used: its tensors travel as torch
``ForkingPickler`` handles to shared memory or CUDA IPC, which only a server on the sender's host can open.

Keys: ``api_key`` (``--api-key``) goes with every request; ``admin_api_key`` (``--admin-api-key``)
replaces it on the control endpoints SGLang marks ``ADMIN_OPTIONAL`` (pause, continue, flush, the
weight-update calls), which then accept only the admin key.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import random
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from env_controller.http.client import PooledHttp, Response, parse_url
from env_controller.http.json_io import dumps_json, loads_json
from env_controller.http.net import free_port
from env_controller.servers.process import start_process, stop_process
from rollout_sglang.engines.protocol import (
    PAUSE_MODES,
    EngineUnavailable,
    GenerationOutput,
    PauseMode,
    Probe,
    SamplingParams,
    check_adapters,
    check_score_inputs,
    routing_starts,
    row_seeds,
)
from rollout_sglang.engines.sglang_options import SGLangClientOptions, SGLangLaunchOptions
from rollout_sglang.engines.sglang_server_args import server_args_argv
from rollout_sglang.routing import RoutingError, RoutingLayout
from rollout_sglang.weight_update.transport import BucketUpdate

logger = logging.getLogger(__name__)

# endpoints SGLang marks @auth_level(AuthLevel.ADMIN_OPTIONAL): with --admin-api-key only that key opens them
ADMIN_ENDPOINTS = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/load_lora_adapter", "/unload_lora_adapter",
})
# sampling_seed is an int64 on the server; unseeded rows get a random base + row, so bases stay below 2**62
_SEED_BASE_LIMIT = 1 << 62
#: the SGLang server option that enables routed-experts capture (0.5.23: ``enable_return_routed_experts``,
#: sglang/srt/arg_groups/fields/exec_.py, a store_true flag); without it SGLang ignores ``return_routed_experts``
CAPTURE_ROUTING_FLAG = "--enable-return-routed-experts"


def version_to_wire(version: int) -> str:
    """A weight version as SGLang's ``weight_version`` field carries it (a string)."""
    return str(version)


def version_from_wire(value: Any) -> int | None:
    """A ``weight_version`` a server reports, as our int; None when it is not one we sent (e.g. ``"default"``)."""
    text = str(value) if value is not None else ""
    return int(text) if text.isdigit() else None


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` for a message about a server's answer: its type and a bounded repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def token_versions_from_spans(spans: Any, num_tokens: int, stamp: int) -> tuple[list[int], int]:
    """Each of ``num_tokens`` output tokens' version, and the output's (its last token's), from SGLang's
    ``meta_info.weight_versions`` (``[{"version": str, "start": int, "end": int}, ...]``, spans over output token
    positions ``[start, end)``).

    A span whose version is not one of ours (:func:`version_from_wire` gives None, e.g. ``"default"``) and
    ``spans`` None (a server that sends none) give the tokens ``stamp``, the client's version as the call
    started; with no tokens the output's version is the last span's. ValueError naming what is wrong when
    ``spans`` is not a non-empty list of such objects that covers ``[0, num_tokens)`` once, in order.
    """
    if spans is None:
        return [stamp] * num_tokens, stamp
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"weight_versions is {_shown(spans)}, not a non-empty list of {{version, start, end}} spans")
    out: list[int] = []
    last = stamp
    for i, span in enumerate(spans):
        if not isinstance(span, dict):
            raise ValueError(f"weight_versions[{i}] is {_shown(span)}, not an object {{version, start, end}}")
        version, start, end = span.get("version"), span.get("start"), span.get("end")
        if not isinstance(version, str):
            raise ValueError(f"weight_versions[{i}].version is {_shown(version)}, not a string")
        for key, bound in (("start", start), ("end", end)):
            if isinstance(bound, bool) or not isinstance(bound, int):
                raise ValueError(f"weight_versions[{i}].{key} is {_shown(bound)}, not an integer token position")
        if start != len(out):
            how = "overlaps the span before it" if start < len(out) else "leaves a gap after the span before it"
            raise ValueError(f"weight_versions[{i}] starts at {start} but the spans before it end at {len(out)}: "
                             f"it {how}")
        if end < start:
            raise ValueError(f"weight_versions[{i}] ends at {end}, before its start {start}")
        if end > num_tokens:
            raise ValueError(f"weight_versions[{i}] ends at {end}, past the {num_tokens} output tokens")
        ours = version_from_wire(version)
        last = stamp if ours is None else ours
        out.extend([last] * (end - start))
    if len(out) != num_tokens:
        raise ValueError(f"weight_versions covers output tokens [0, {len(out)}) of {num_tokens}; the spans must "
                         "cover every output token")
    return out, (out[-1] if out else last)


class SGLangError(RuntimeError):
    """The SGLang server answered with an error, or could not be reached or started."""


class SGLangUnavailable(SGLangError, EngineUnavailable):
    """The server could not serve: unreachable, a 5xx answer, or the request aborted (another engine may)."""


class SGLangTimeout(SGLangUnavailable, TimeoutError):
    """An SGLang call or the server start did not finish within its timeout."""


def _tail(path: Path | None, n: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def sampling_params_to_sglang(params: SamplingParams, seeds: list[int | None]) -> list[dict[str, Any]]:
    """SGLang ``sampling_params`` for one prompt per entry of ``seeds`` (each row's seed, :func:`row_seeds`), one
    dict per row, each with its own ``sampling_seed``.

    A row without a seed gets ``base + i``, ``base`` a fresh random number: under SGLang's
    ``--enable-deterministic-inference`` a row without a seed samples with seed 42, so the rows of a
    GRPO group would all come out the same. ``skip_special_tokens``/``no_stop_trim`` keep every
    token id as sampled.
    """
    base: dict[str, Any] = {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    unseeded = random.SystemRandom().randrange(_SEED_BASE_LIMIT)
    return [{**base, "sampling_seed": unseeded + i if seed is None else seed} for i, seed in enumerate(seeds)]



def launch_flags(model_path: str | os.PathLike, options: SGLangLaunchOptions, client: SGLangClientOptions, tp: int,
                 port: int) -> list[str]:
    """The flags of ``sglang.launch_server`` for a server of ``model_path`` on ``tp`` GPUs at ``port``: the ones the
    project sets (:meth:`SGLangEngine.launch`), then ``options.server_args``."""
    o = options
    cmd = ["--model-path", str(model_path), "--host", o.host, "--port", str(port), "--tp-size", str(tp),
           "--dtype", o.dtype, "--skip-tokenizer-init"]
    if o.capture_routing:
        cmd.append(CAPTURE_ROUTING_FLAG)
    cmd += o.lora_args()
    for flag, key in (("--api-key", client.api_key), ("--admin-api-key", client.admin_api_key)):
        if key:
            cmd += [flag, key]
    return cmd + server_args_argv(o.server_args, f"{o.KEY}.server_args")


#: idle connections of the ``/generate`` pools are closed after this long (seconds)
KEEPALIVE_S = 4.0


class HttpxPool:
    """:meth:`PooledHttp.request <env_controller.http.client.PooledHttp.request>` over an ``httpx.AsyncClient`` with
    ``limits``: the SGLang client's pool for ``https://`` servers, which the pooled HTTP/1.1 client does not speak."""

    def __init__(self, limits: httpx.Limits) -> None:
        self.client = httpx.AsyncClient(limits=limits)

    async def request(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str],
                      timeout_s: float) -> Response:
        """The whole reply within ``timeout_s``; TimeoutError past it, OSError when the server cannot be reached or
        the connection breaks."""
        try:
            r = await self.client.request(method, url, content=body, headers=headers, timeout=httpx.Timeout(timeout_s))
        except httpx.TimeoutException as e:
            raise TimeoutError(str(e)) from e
        except httpx.HTTPError as e:
            raise OSError(f"{type(e).__name__}: {e}") from e
        return Response(r.status_code, dict(r.headers), r.content)


class SGLangEngine:
    """Client of one SGLang server (optionally owning its process).

    base_url: e.g. "http://10.0.0.5:30000".
    options: our settings of the client: timeouts, pause mode, keys (:class:`SGLangClientOptions`).
    version: the weight version the server starts with.
    num_ranks: GPUs (TP ranks) of the server; each joins the weight-sync group. None: the server's
        ``tp_size`` from ``GET /server_info``, asked on first use.
    routing_layout: MoE models: the model's routing layout (:mod:`rollout_sglang.routing`), needed to ask for
        and check routed experts (``generate(..., routing_from=...)``); None: the client asks for none.
    process / log_path: the server process when this client launched it (see :meth:`launch`).
    """

    #: SGLang's scheduler batches the requests it has continuously: :class:`BatchingEngine` sends calls as they come
    continuous_batching = True

    def __init__(self, base_url: str, options: SGLangClientOptions | None = None, *, version: int = 0,
                 num_ranks: int | None = None, routing_layout: RoutingLayout | None = None,
                 process: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        if num_ranks is not None and num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be >= 1 (the server's tensor-parallel size), or None to "
                             "ask the server")
        o = self.options = options if options is not None else SGLangClientOptions()
        self.base_url = base_url.rstrip("/")
        self.name = self.base_url
        self.version: int = int(version)
        self._num_ranks = None if num_ranks is None else int(num_ranks)
        self.request_timeout_s = float(o.request_timeout_s)
        self.control_timeout_s = float(o.control_timeout_s)
        self.update_timeout_s = float(o.update_timeout_s)
        self.pause_mode = o.pause_mode
        self.headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
        self._json_headers = {"Content-Type": "application/json", **self.headers}
        self._admin_headers = {"Authorization": f"Bearer {o.admin_api_key}"} if o.admin_api_key else self.headers
        self.process = process
        self.log_path = log_path
        self.routing_layout = routing_layout
        self._pending_version: int | None = None
        self._extensions: list[str] | None = None
        self._paused = False
        self._pause_sent: str | None = None  # the SGLang mode the current pause sent (None: not paused)
        self._held_mode: PauseMode | None = None  # the mode of a pause that holds running requests (in-flight update)
        self._stale_prefix_cache = False  # an update's flush was skipped (in_place): old-weights KV may be reused
        self._adapter_versions: dict[str, int] = {}  # adapters loaded through this client: name -> weight version
        self._local = threading.local()  # one HTTP client per thread: building one is costly
        #: the async HTTP pool of each event loop that called (:meth:`_post_async`)
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        try:
            parse_url(self.base_url)
            self._plain = True  # http://: the pooled HTTP/1.1 client
        except ValueError:
            self._plain = False  # https:// (or what only httpx reads)

    # ------------------------------------------------------------------ plumbing
    def _url(self, endpoint: str) -> str:
        return f"{self.base_url}{endpoint}"

    def _raise_for(self, endpoint: str, status: int, raw: bytes) -> Any:
        """Decode an answer (HTTP ``status``, body ``raw``) as JSON, else text; SGLangError on HTTP errors and
        ``success: false``."""
        try:
            body: Any = loads_json(raw, strict=False) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        if status >= 400:
            msg = (body.get("message") or body.get("error_message") or body.get("error") or body
                   if isinstance(body, dict) else body)
            hint = ""
            if status in (401, 403):
                hint = ("; the server wants a key: pass api_key (its --api-key), and admin_api_key (its "
                        "--admin-api-key) for the control endpoints")
            cls = SGLangUnavailable if status >= 500 else SGLangError
            raise cls(f"{endpoint} on {self.base_url} failed with HTTP {status}: {msg}{hint}")
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangError(f"{endpoint} on {self.base_url} refused: "
                              f"{body.get('message') or body.get('error_message') or body}")
        return body

    def _client(self) -> httpx.Client:
        """This thread's HTTP client (connections are kept alive between calls)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(headers=self.headers)
            self._local.client = client
        return client

    async def _post_async(self, endpoint: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
        """POST ``body`` as JSON from the running event loop: ``(status, body)`` of the answer within ``timeout_s``
        (waiting for a connection included); TimeoutError past it, OSError when the server cannot be reached or
        drops the connection.

        One pool per event loop, at most ``max_connections`` open: :class:`~env_controller.http.client.PooledHttp`
        for ``http://``, :class:`HttpxPool` for ``https://``. A rollout keeps a request open for each running turn,
        thousands at once, and httpx's pool takes CPU that grows with the requests waiting on it
        (docs/BENCHMARKS.md, ``bench/rollout_http.py``)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            n = self.options.max_connections
            # idle connections are closed before SGLang's server drops them (its keep-alive timeout,
            # SGLANG_TIMEOUT_KEEP_ALIVE, is 5 s), so a turn is never sent on one that is closing
            pool = self._pools[loop] = (PooledHttp(max_in_flight=n, keepalive_s=KEEPALIVE_S) if self._plain
                                        else HttpxPool(httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                                                    keepalive_expiry=KEEPALIVE_S)))
        reply = await pool.request("POST", self._url(endpoint), dumps_json(body), self._json_headers, timeout_s)
        return reply.status, reply.body

    def _call(self, method: str, endpoint: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        """One blocking HTTP call with a timeout (the admin key on admin endpoints); returns the decoded answer."""
        t = self.control_timeout_s if timeout_s is None else float(timeout_s)
        headers = self._admin_headers if endpoint in ADMIN_ENDPOINTS else None
        try:
            resp = self._client().request(method, self._url(endpoint), json=body, timeout=httpx.Timeout(t),
                                          headers=headers)
        except httpx.TimeoutException as e:
            raise SGLangTimeout(
                f"{endpoint} on {self.base_url} did not answer within {t:.1f}s; the server is stalled or "
                "overloaded (check its log; raise the timeout for very large requests)"
            ) from e
        except httpx.HTTPError as e:
            raise SGLangUnavailable(
                f"{endpoint} on {self.base_url} could not be reached: {e!r}; is the server running?") from e
        return self._raise_for(endpoint, resp.status_code, resp.content)

    # ---------------------------------------------------------------- generation
    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       routing_from: list[int] | None = None,
                       adapters: list[str | None] | None = None,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """Continue each prompt (token ids); one output per prompt with its token ids and log-probs.

        seeds: one seed or None per prompt, sent as its ``sampling_seed`` in place of ``params.seed + i``
            (:func:`~rollout_sglang.engines.protocol.row_seeds`).

        adapters: LoRA runs: one per prompt, the name of an adapter loaded through this client
            (:meth:`load_adapter`) or None for the base; sent as SGLang's ``lora_path``, and each output carries
            its adapter's version (a row without one: the client's ``version``). ValueError naming an adapter this
            client did not load (its version would be unknown).

        routing_from: MoE models (the client needs ``routing_layout``): a start per prompt in ``[0, len(prompt)]``;
            output ``i`` then carries the routed experts of positions ``[routing_from[i], len(prompt) +
            len(generated) - 1)``, MoE layers only. Prompts that share a start go in one request.
        Each output carries each token's version from the server's spans (``token_versions``; a call that an
        in-flight update crossed holds two versions), its ``version`` the last token's.
        Raises SGLangTimeout after ``request_timeout_s``, SGLangError when the server refuses the
        request, aborts it, or answers with mismatched token/log-prob lists; SGLangUnavailable for a
        malformed routing record or weight-version spans.
        """
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        names = check_adapters(prompts, adapters)
        if names is not None:
            unknown = sorted({n for n in names if n is not None and n not in self._adapter_versions})
            if unknown:
                raise ValueError(f"adapters {unknown} were not loaded on {self.base_url} through this client "
                                 f"(loaded: {sorted(self._adapter_versions) or 'none'}); load_adapter() them first")
        versions = dict(self._adapter_versions)  # as the call starts: an adapter loaded meanwhile is not in it
        sp = sampling_params_to_sglang(params, row_seeds(prompts, params, seeds))
        groups: dict[int | None, list[int]] = {}
        if routing_from is None:
            groups[None] = list(range(len(prompts)))
        else:
            for i, start in enumerate(self._check_routing_from(prompts, routing_from)):
                groups.setdefault(start, []).append(i)
        version = self.version
        tasks = [asyncio.ensure_future(self._generate_rows(prompts, rows, sp, start, params, version, names,
                                                                 versions))
                 for start, rows in groups.items()]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        out: list[GenerationOutput | None] = [None] * len(prompts)
        for rows, res in zip(groups.values(), results):
            for i, o in zip(rows, res):
                out[i] = o
        return out  # type: ignore[return-value]

    async def _post_generate(self, body: dict[str, Any], count: int, what: str) -> list[dict[str, Any]]:
        """POST ``body`` to ``/generate`` within ``request_timeout_s``; its ``count`` results (``what``: the call,
        for the messages). SGLangTimeout, SGLangUnavailable, or SGLangError for a refusal or a wrong count."""
        t = self.request_timeout_s
        try:
            status, raw = await asyncio.wait_for(self._post_async("/generate", body, t), t + 1.0)
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise SGLangTimeout(f"/generate on {self.base_url} ({what}) did not answer within {t:.1f}s; the server "
                                "is stalled or overloaded (raise request_timeout_s?)") from e
        except OSError as e:
            raise SGLangUnavailable(
                f"/generate on {self.base_url} could not be reached: {e!r}; is the server running?") from e
        data = self._raise_for("/generate", status, raw)
        items = data if isinstance(data, list) else [data]
        if len(items) != count:
            raise SGLangError(f"/generate on {self.base_url} returned {len(items)} results for {count} ({what})")
        return items

    async def score(self, sequences: list[list[int]], starts: list[int] | None = None) -> list[list[float]]:
        """Each token's log-prob given the tokens before it, under the server's current weights (the base model),
        untempered (:meth:`Engine.score <rollout_sglang.engines.protocol.Engine.score>`): one ``/generate`` of all
        sequences with ``max_new_tokens: 0``, ``return_logprob: true`` and ``logprob_start_len: max(start - 1, 0)``
        per sequence, read from ``meta_info.input_token_logprobs`` (the module doc says why one before the start).
        ``out[i]`` has ``len(sequences[i])`` floats, 0.0 at position 0 and before ``starts[i]``.

        ValueError (:func:`~rollout_sglang.engines.protocol.check_score_inputs`) for an empty sequence, a negative
        id or a start outside ``[0, len(sequence)]``. The client does not know the vocabulary, and SGLang 0.5.23 does
        not check input ids against it (it clamps the gathered ids, ``ScheduleBatch.prepare_for_extend``): ids must
        be the model's (the stand-in refuses others with HTTP 400). Raises SGLangTimeout after
        ``request_timeout_s``, SGLangError when the server refuses the request or answers log-probs that do not fit
        the sequences (naming server, endpoint and row), SGLangUnavailable when it cannot serve or aborts the
        request.
        """
        seqs, firsts = check_score_inputs(sequences, starts)
        if not seqs:
            return []
        asks = [max(s - 1, 0) for s in firsts]
        body: dict[str, Any] = {"input_ids": seqs, "sampling_params": [{"max_new_tokens": 0} for _ in seqs],
                                "return_logprob": True, "logprob_start_len": asks}
        items = await self._post_generate(body, len(seqs), f"scoring {len(seqs)} sequences, "
                                          f"{sum(map(len, seqs))} tokens")
        return [self._parse_scores(i, item, seq, ask, start)
                for i, (item, seq, ask, start) in enumerate(zip(items, seqs, asks, firsts))]

    def _parse_scores(self, row: int, item: Any, seq: list[int], ask: int, start: int) -> list[float]:
        """Row ``row``'s ``meta_info.input_token_logprobs`` (asked from ``ask``) as the log-probs of ``seq``'s
        positions, 0.0 before ``start`` and at ``ask``. The answer is the server's, never trusted: SGLangError naming
        the row and what is wrong; SGLangUnavailable for an aborted request."""
        where = f"/generate on {self.base_url}, scored row {row}"
        if not isinstance(item, dict) or not isinstance(item.get("meta_info") or {}, dict):
            raise SGLangError(f"{where}: the answer is {_shown(item)}, not a JSON object with a meta_info object")
        meta = item.get("meta_info") or {}
        fr = meta.get("finish_reason")
        if isinstance(fr, dict) and fr.get("type") == "abort":
            raise SGLangUnavailable(f"{where} was aborted ({fr.get('message', '')})")
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list):
            raise SGLangError(f"{where}: meta_info.input_token_logprobs is {_shown(entries)}, not a list (was "
                              "return_logprob or logprob_start_len dropped?)")
        if len(entries) != len(seq) - ask:
            raise SGLangError(f"{where}: {len(entries)} input log-probs for positions [{ask}, {len(seq)}) of a "
                              f"{len(seq)}-token sequence; expected {len(seq) - ask}")
        out = [0.0] * len(seq)
        for k, entry in enumerate(entries[1:], start=1):  # entry 0 (position ``ask``) is None: not computed
            pos = ask + k
            ok = isinstance(entry, (list, tuple)) and len(entry) >= 2
            lp, tok = (entry[0], entry[1]) if ok else (None, None)
            if not ok or isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp or lp > 0:
                raise SGLangError(f"{where}: input_token_logprobs[{k}] (position {pos}) is {_shown(entry)}, not "
                                  "[logprob <= 0, token_id, text]")
            if tok != seq[pos] and tok != 0:  # SGLang reports 0 for an id >= vocab_size - 1
                raise SGLangError(f"{where}: input_token_logprobs[{k}] names token {tok!r} at position {pos}, where "
                                  f"the sequence has {seq[pos]}")
            if pos >= start:
                out[pos] = float(lp)
        return out

    def _check_routing_from(self, prompts: list[list[int]], routing_from: list[int]) -> list[int]:
        """ValueError unless the client has a routing layout and the starts fit the prompts
        (:func:`routing_starts`)."""
        if self.routing_layout is None:
            raise ValueError(f"routing_from given, but the client of {self.base_url} has no routing_layout: build it "
                             "with SGLangEngine(..., routing_layout=...) for a MoE model (a dense model has none)")
        return routing_starts(prompts, routing_from)

    async def _generate_rows(self, prompts: list[list[int]], rows: list[int], sp: list[dict[str, Any]],
                             start: int | None, params: SamplingParams, version: int,
                             adapters: list[str | None] | None = None,
                             adapter_versions: Mapping[str, int] | None = None) -> list[GenerationOutput]:
        """One ``/generate`` for ``rows`` of ``prompts`` (their own sampling params); routing from ``start`` on;
        ``adapters``: each prompt's adapter (None: the base for all), ``adapter_versions`` their versions."""
        body: dict[str, Any] = {"input_ids": [list(map(int, prompts[i])) for i in rows],
                                "sampling_params": [sp[i] for i in rows], "return_logprob": True}
        # SGLang resolves lora_path only when it is truthy; a list of nulls would still go through its LoRA checks
        # (and be refused by a server without --enable-lora), so rows that are all on the base send none
        lora = [adapters[i] for i in rows] if adapters is not None else []
        if any(n is not None for n in lora):
            body["lora_path"] = lora
        if start is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = start
        items = await self._post_generate(body, len(rows),
                                          f"{len(rows)} prompts, max_new_tokens={params.max_new_tokens}")
        outs = []
        for k, (i, item) in enumerate(zip(rows, items)):
            o = self._parse_output(i, item, version)
            if lora and lora[k] is not None:  # the server's versions are the base's; the adapter is the version
                o.version = (adapter_versions or {}).get(lora[k], version)
                o.token_versions = [o.version] * len(o.token_ids)
            if start is not None:
                o.routed_experts = self._parse_routing(i, item, len(prompts[i]), len(o.token_ids), start)
            outs.append(o)
        return outs

    def _parse_routing(self, row: int, item: dict, prompt_len: int, generated: int, start: int) -> np.ndarray:
        """Row ``row``'s ``meta_info.routed_experts`` as a record of the MoE layers (``RoutingLayout.check``).

        SGLang 0.5.23 sends base64 of the int32 ``[positions, num_hidden_layers, top_k]`` array of positions
        ``[start, seqlen - 1)`` (dense layers hold zeros, dropped here). A server started without
        ``--enable-return-routed-experts`` sends no such key: SGLangError naming the flag (a launch setting, the
        same on every call: retrying elsewhere would not fix it). A record that does not decode or fit the model
        is hostile input from that engine, never trusted: SGLangUnavailable, an EngineUnavailable, because the
        request was sound (its starts were checked here) and the engine's answer was not (a server with another
        model, corrupt capture buffers); the version pool then takes that engine out of rotation and sends the
        rows to another engine, so a bad server neither fails the episode nor feeds wrong routing to training.
        """
        layout = self.routing_layout
        assert layout is not None
        meta = item.get("meta_info") or {}
        where = f"/generate on {self.base_url}, row {row}"
        if "routed_experts" not in meta:
            raise SGLangError(f"{where}: the answer has no meta_info.routed_experts although the request asked for "
                              f"them: the server was started without {CAPTURE_ROUTING_FLAG} (SGLang then ignores "
                              "return_routed_experts); relaunch it with that flag, or set rollout.capture_routing=off")
        raw = meta["routed_experts"]
        try:
            if not isinstance(raw, str):
                raise RoutingError(f"{where}: routed_experts is a {type(raw).__name__} ({str(raw)[:80]!r}), not a "
                                   "base64 string")
            try:
                data = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError) as e:
                raise RoutingError(f"{where}: routed_experts {raw[:40]!r}... is not valid base64 ({e})") from None
            seqlen = prompt_len + generated
            positions = max(0, seqlen - 1 - start)
            want = positions * layout.num_layers * layout.top_k
            if len(data) != 4 * want:
                raise RoutingError(f"{where}: routed_experts of {len(data)} bytes, expected {4 * want} (int32 "
                                   f"[{positions} positions [{start}, {seqlen - 1}), {layout.num_layers} layers, "
                                   f"top-{layout.top_k}])")
            arr = np.frombuffer(data, dtype="<i4").reshape(positions, layout.num_layers, layout.top_k)
            return layout.check(arr[:, list(layout.moe_layers), :], positions, where)
        except RoutingError as e:
            raise SGLangUnavailable(f"malformed routed experts from {self.base_url}: {e}") from None

    def _parse_output(self, row: int, item: Any, version: int) -> GenerationOutput:
        """Row ``row``'s answer as an output: token ids, log-probs, finish reason and each token's version
        (:func:`token_versions_from_spans`; ``version``: the client's stamp as the call started). The answer is
        the server's, so never trusted: SGLangError naming the row and what is wrong, never a KeyError."""
        where = f"/generate on {self.base_url}, row {row}"
        if not isinstance(item, dict):
            raise SGLangError(f"{where}: the answer is {_shown(item)}, not a JSON object")
        meta = item.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise SGLangError(f"{where}: meta_info is {_shown(meta)}, not a JSON object")
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        if kind == "abort":
            why = fr.get("message", "") if isinstance(fr, dict) else ""
            raise SGLangUnavailable(
                f"{where} was aborted ({why}); the server was paused in 'abort' mode or ran out of memory while "
                "the request ran"
            )
        lps = meta.get("output_token_logprobs")
        if lps is None:
            raise SGLangError(f"/generate on {self.base_url}: no output_token_logprobs in the answer "
                              "(was return_logprob dropped?)")
        try:
            ids = item.get("output_ids")
            if ids is None:
                ids = [int(x[1]) for x in lps]
            ids = [int(x) for x in ids]
            logprobs = [float(x[0]) for x in lps]
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise SGLangError(f"{where}: output_ids / output_token_logprobs are malformed ({e!r}); expected token "
                              "ids and [logprob, token_id, text] triples") from None
        if len(ids) != len(logprobs):
            raise SGLangError(f"/generate on {self.base_url}: row {row} has {len(ids)} output ids but "
                              f"{len(logprobs)} log-probs")
        spans = meta.get("weight_versions")
        try:
            token_versions, last = token_versions_from_spans(spans, len(ids), version)
        except ValueError as e:
            raise SGLangUnavailable(f"malformed weight versions from {self.base_url} ({where}): {e}") from None
        if spans is None:  # a server without spans: the stamp stands for every token; say when the server differs
            reported = version_from_wire(meta.get("weight_version"))
            if reported is not None and reported != version:
                logger.warning("%s reports weight_version %d while the client stamp is %d", self.base_url, reported,
                               version)
        return GenerationOutput(ids, logprobs, "stop" if kind == "stop" else "length", last,
                                token_versions=token_versions)

    # ----------------------------------------------------------- pause / resume
    def pause(self, mode: PauseMode | None = None) -> None:
        """``POST /pause_generation {"mode"}`` for a weight update.

        ``mode`` None: the configured ``pause_mode`` ('abort' by default; the version pool drained the engine
        first, so nothing is held). ``"in_place"`` / ``"retract"``: SGLang holds the running requests for an
        in-flight update, with their KV cache (in_place) or back in its waiting queue, their KV recomputed after
        :meth:`resume` (retract); the module's table says what the update then sends. ValueError for another mode.
        """
        if mode is not None and mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)} (or None: the configured "
                             f"{self.pause_mode!r}, for an engine the version pool drained)")
        sent = self.pause_mode if mode is None else mode
        self._call("POST", "/pause_generation", {"mode": sent})
        self._paused, self._pause_sent, self._held_mode = True, sent, mode

    def resume(self) -> None:
        """``POST /continue_generation {}``: held requests continue, new ones are admitted."""
        self._call("POST", "/continue_generation", {})
        self._paused, self._pause_sent, self._held_mode = False, None, None

    def flush_cache(self) -> None:
        """``POST /flush_cache``: drop the prefix (radix) cache, whose KV was computed with old weights. SGLang
        refuses it (SGLangError) while requests run, or are held by an ``in_place`` pause."""
        self._call("POST", "/flush_cache", None)
        self._stale_prefix_cache = False

    def flush_if_stale(self) -> bool:
        """Flush the prefix cache that an ``in_place`` update left holding old-weights KV (the version pool calls it
        when the server is idle); True when it flushed, False when nothing was owed or SGLang refused because
        requests run (it stays owed)."""
        if not self._stale_prefix_cache:
            return False
        try:
            self.flush_cache()
        except SGLangError as e:
            logger.debug("%s: the owed prefix-cache flush waits (%s)", self.base_url, e)
            return False
        return True

    # ------------------------------------------------------------- LoRA adapters
    def load_adapter(self, adapter: Any) -> None:
        """Load ``adapter`` (an :class:`~rollout_sglang.engines.adapter.Adapter`) on the server under ``adapter.name``
        (``POST /load_lora_adapter``); the server reads it from ``adapter.path``, so that directory must be one the
        server can read (a shared filesystem on a cluster).

        ValueError when the adapter has no path (save it first: ``Adapter.save``); SGLangError naming the adapter,
        the server and SGLang's reason when the server refuses it (LoRA not enabled, a name loaded already, a rank
        above ``--max-lora-rank``, modules outside ``--lora-target-modules``); SGLangUnavailable when the server
        cannot be reached or times out (``update_timeout_s``).
        """
        name = adapter.name
        if adapter.path is None:
            raise ValueError(f"adapter {name} (version {adapter.version}) has no path: {self.base_url} is another "
                             "process and reads adapters from disk; save it first (Adapter.save(dir), a directory "
                             "the server can read) and load the saved adapter")
        body = {"lora_name": name, "lora_path": str(adapter.path), "pinned": False}
        try:
            self._call("POST", "/load_lora_adapter", body, self.update_timeout_s)
        except SGLangUnavailable:
            raise
        except SGLangError as e:
            raise SGLangError(f"loading LoRA adapter {name} (version {adapter.version}) from {adapter.path} on "
                              f"{self.base_url} failed: {e}") from None
        self._adapter_versions[name] = int(adapter.version)
        logger.debug("%s: adapter %s (version %d) loaded from %s", self.base_url, name, adapter.version, adapter.path)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (``POST /unload_lora_adapter``; SGLang waits for the requests that use it).
        SGLangError naming it when the server refuses (e.g. no adapter of that name), SGLangUnavailable when
        unreachable."""
        try:
            self._call("POST", "/unload_lora_adapter", {"lora_name": name}, self.update_timeout_s)
        except SGLangUnavailable:
            raise
        except SGLangError as e:
            raise SGLangError(f"unloading LoRA adapter {name} on {self.base_url} failed: {e}") from None
        self._adapter_versions.pop(name, None)

    @property
    def adapters(self) -> list[str]:
        """The names of the adapters loaded through this client."""
        return list(self._adapter_versions)

    # ------------------------------------------------------------------- health
    def health(self) -> dict:
        """``{"ok", "version", "paused", "pause_mode", "server_pause_mode", "stale_prefix_cache", "updating", "url",
        "server_weight_version"}``; ok False when unreachable.

        pause_mode: the mode of a pause that holds running requests ("in_place" / "retract"), None when not
        paused or paused drained (as the local engine's). server_pause_mode: the SGLang mode the current pause
        sent (None: not paused). stale_prefix_cache: an ``in_place`` update skipped its flush, so the prefix
        cache may still hold KV of the old weights (:meth:`flush_cache` when idle clears it).
        server_weight_version: the version the server reports (``GET /model_info``), an int; None when
        unreachable or not one of ours (a fresh SGLang server reports ``"default"``).
        """
        out = {"ok": False, "version": self.version, "paused": self._paused, "pause_mode": self._held_mode,
               "server_pause_mode": self._pause_sent, "stale_prefix_cache": self._stale_prefix_cache,
               "updating": self._pending_version is not None, "url": self.base_url, "server_weight_version": None}
        try:
            client, t = self._client(), httpx.Timeout(self.control_timeout_s)
            resp = client.get(self._url("/health"), timeout=t)
            out["ok"] = resp.status_code == 200
            if out["ok"]:
                info = client.get(self._url("/model_info"), timeout=t)
                if info.status_code == 200:
                    out["server_weight_version"] = version_from_wire(info.json().get("weight_version"))
        except httpx.HTTPError as e:
            out["error"] = repr(e)
        return out

    def probe(self, timeout_s: float) -> Probe:
        """Health probe of the version pool: ``GET /health_generate`` (SGLang runs a one-token generation
        unless requests are running, so a stalled scheduler fails it) and the ``weight_version`` of
        ``GET /model_info``; never raises."""
        t = httpx.Timeout(timeout_s)
        try:
            resp = self._client().get(self._url("/health_generate"), timeout=t)
            if resp.status_code != 200:
                return Probe(False, error=f"/health_generate answered HTTP {resp.status_code}")
            info = self._client().get(self._url("/model_info"), timeout=t)
            if info.status_code != 200:
                return Probe(False, error=f"/model_info answered HTTP {info.status_code}")
            return Probe(True, version_from_wire(info.json().get("weight_version")))
        except httpx.TimeoutException:
            return Probe(False, error=f"no answer to the health probe within {timeout_s:.1f}s (stalled?)")
        except (httpx.HTTPError, ValueError) as e:
            return Probe(False, error=f"health probe failed: {e!r}")

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll ``GET /health`` until 200; SGLangTimeout after ``timeout_s``, SGLangError when our process died."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise SGLangError(
                    f"the SGLang server for {self.base_url} exited with code {self.process.returncode} before it "
                    f"became healthy; last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                t = httpx.Timeout(max(0.5, min(5.0, deadline - time.monotonic())))
                if self._client().get(self._url("/health"), timeout=t).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise SGLangTimeout(
                    f"the SGLang server at {self.base_url} was not healthy within {timeout_s:.0f}s (model load, CUDA "
                    f"graph capture); raise engine_startup_timeout_s or check {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(poll_s)

    def take_over(self) -> None:
        """Make a server that an earlier trainer left mid-update serve again, before this run uses it: ``POST
        /continue_generation`` (SGLang accepts it when not paused; a paused server would also fail every
        ``/health_generate`` probe, so the version pool would never route to it) and close a weight-update session
        left open (``POST /end_weight_update``; SGLang's "no weight-update session is open" is the usual answer)."""
        self.resume()
        try:
            self._call("POST", "/end_weight_update", {})
        except SGLangError as e:
            if "no weight-update session" not in str(e):
                raise
        else:
            logger.warning("%s had a weight-update session open (a trainer died mid-update): closed", self.base_url)

    def server_info(self) -> dict:
        """``GET /server_info``: the server's resolved launch arguments (``tp_size``, ...) and scheduler state."""
        info = self._call("GET", "/server_info")
        if not isinstance(info, dict):
            raise SGLangError(f"/server_info on {self.base_url} answered {str(info)[:200]!r}, not a JSON object")
        return info

    @property
    def num_ranks(self) -> int:
        """Ranks this server contributes to a weight-sync group: its tensor-parallel size (asked once).

        SGLang joins a weight-update group at ``rank_offset + tp_rank`` from every TP rank; a server
        with ``dp_size`` or ``pp_size`` above 1 would put several ranks on one offset, so it is refused.
        """
        if self._num_ranks is None:
            info = self.server_info()
            sizes = {k: info.get(k, 1) for k in ("tp_size", "pp_size", "dp_size")}
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes.values()):
                raise SGLangError(f"/server_info on {self.base_url} reports {sizes}; expected positive integers "
                                  "(pass num_ranks= to the client to skip the question)")
            if sizes["pp_size"] > 1 or sizes["dp_size"] > 1:
                raise SGLangError(
                    f"{self.base_url} runs with pp_size={sizes['pp_size']}, dp_size={sizes['dp_size']}: SGLang joins a "
                    "weight-update group at rank_offset + tp_rank only, so replicas or stages would collide; launch "
                    "one server per data-parallel replica with --pp-size 1")
            self._num_ranks = int(sizes["tp_size"])
        return self._num_ranks

    def has_extension(self, name: str) -> bool:
        """Whether ``/server_info`` lists ``name`` in ``agentrl_extensions`` (asked once; SGLang lists none)."""
        if self._extensions is None:
            try:
                self._extensions = list(self.server_info().get("agentrl_extensions", []))
            except SGLangError as e:
                logger.warning("%s: GET /server_info failed (%s); treating it as a plain SGLang server (no "
                               "extensions)", self.base_url, e)
                self._extensions = []
        return name in self._extensions

    # ------------------------------------------------------------ weight update
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: float | None = None) -> None:
        """``POST /init_weights_update_group``; blocks until the server joined the group (the trainer joins too)."""
        self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend,
        }, timeout_s if timeout_s is not None else self.update_timeout_s)

    def update_weights_from_distributed(self, bucket: BucketUpdate, *, last_bucket: bool = False,
                                        timeout_s: float | None = None,
                                        extra_fields: Mapping[str, Any] | None = None) -> None:
        """``POST /update_weights_from_distributed``: the server receives ``bucket``'s tensors from group rank 0 and
        loads them.

        ``bucket.load_format`` "flattened_bucket": one broadcast of the flat bucket (SGLang >= 0.5.2), None:
        one broadcast per tensor. ``last_bucket``: the update's last bucket; when this client opened
        the update (:meth:`begin_weight_update`), the request carries its version as SGLang's
        ``weight_version``, which the server then reports. ``timeout_s``: limit on the call (None: the
        client's ``update_timeout_s``). ``extra_fields``: request fields beyond
        SGLang's, from a transport for servers that list the matching extension (ValueError when one
        would replace an SGLang field). In an ``in_place`` pause the request asks for no flush, whatever
        ``bucket.flush_cache`` says: SGLang's updater would fail it, as the held requests keep the scheduler busy.
        """
        body = bucket.body()
        if self._held_mode == "in_place" and body.get("flush_cache"):
            body["flush_cache"] = False
        if last_bucket and self._pending_version is not None:
            body["weight_version"] = version_to_wire(self._pending_version)
        if extra_fields:
            clash = sorted(set(extra_fields) & set(body))
            if clash:
                raise ValueError(f"extra_fields {clash} would replace SGLang's own request fields; "
                                 "give extension fields other names")
            body.update(extra_fields)
        self._call("POST", "/update_weights_from_distributed", body,
                   timeout_s if timeout_s is not None else self.update_timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                     timeout_s: float | None = None) -> None:
        """``POST /destroy_weights_update_group {"group_name"}``."""
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    def begin_weight_update(self, version: int, metadata: dict | None = None) -> None:
        """Open the server's weight-update session for ``version`` (``POST /begin_weight_update``); the
        buckets then arrive over the weight-sync group.

        A session the server still holds from an update that never closed (a trainer that died
        mid-sync) is closed first: its weights are about to be overwritten anyway.
        """
        if self._pending_version is not None:
            raise RuntimeError(f"weight update to version {self._pending_version} of {self.base_url} is still open")
        try:
            self._call("POST", "/begin_weight_update", {})
        except SGLangError as e:
            if "already open" not in str(e):
                raise
            logger.warning("%s still had a weight-update session open (an earlier update did not finish); closing "
                           "it before updating to version %d", self.base_url, version)
            self._call("POST", "/end_weight_update", {})
            self._call("POST", "/begin_weight_update", {})
        self._pending_version = int(version)

    def receive_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Not available: an SGLang server receives buckets over the weight-sync group, not in-process."""
        raise NotImplementedError(
            f"SGLangEngine ({self.base_url}) receives weights over a weight-sync group: use the trainer's "
            "WeightSender (megatron_agentrl.weight_sync) or a BucketBroadcaster (rollout_sglang.weight_update) with "
            "this engine as a target"
        )

    def end_weight_update(self) -> None:
        """Finish the update: close the server's session (``POST /end_weight_update``, which finalizes the
        loaded weights), flush the prefix cache and stamp the new version.

        In an ``in_place`` pause there is no flush (SGLang refuses it while the held requests sit in its running
        batch): the prefix cache keeps old-weights KV until evicted or flushed later (``stale_prefix_cache``). A
        ``/generate`` call in flight across the update takes its tokens' versions from the server's spans, not
        from this stamp.
        """
        if self._pending_version is None:
            raise RuntimeError(f"end_weight_update() on {self.base_url} without begin_weight_update()")
        try:
            self._call("POST", "/end_weight_update", {})
            if self._held_mode == "in_place":
                self._stale_prefix_cache = True
            else:
                self.flush_cache()
        except BaseException:
            self._pending_version = None  # the server's session is closed or unknown: a new begin sorts it out
            raise
        self.version, self._pending_version = self._pending_version, None

    def abort_weight_update(self) -> None:
        """Close an update that failed: the server's session ends (best effort, so the next update can
        begin) and no version is stamped (the weights may be partial)."""
        self._pending_version = None
        try:
            self._call("POST", "/end_weight_update", {})
        except SGLangError as e:
            logger.warning("%s: closing the failed weight update's session failed (%s); the next update closes it",
                           self.base_url, e)

    # ------------------------------------------------------------------ process
    @classmethod
    def launch(cls, model_path: str | os.PathLike, options: SGLangLaunchOptions | None = None,
               client: SGLangClientOptions | None = None, *, gpus: Sequence[int] = (),
               routing_layout: RoutingLayout | None = None) -> "SGLangEngine":
        """Start ``python -m sglang.launch_server`` on ``gpus`` as ``options`` say, and wait until it is healthy;
        returns its client (``client``'s settings, ``routing_layout`` for a MoE model).

        The server gets ``--model-path --host --port --tp-size len(gpus) --dtype --skip-tokenizer-init``
        (token ids in and out), with ``capture_routing`` (MoE models) ``--enable-return-routed-experts``,
        the LoRA flags of ``options`` (:meth:`~rollout_sglang.engines.sglang_options.LoraServerFlags.lora_args`),
        ``--api-key`` / ``--admin-api-key`` when the client's ``api_key`` / ``admin_api_key`` are given (so it
        accepts this client's requests and no keyless ones; the logged command line hides them), plus
        the flags of ``server_args`` (:func:`~rollout_sglang.engines.sglang_server_args.server_args_argv`);
        ``CUDA_VISIBLE_DEVICES`` is set to ``gpus``. Its
        output goes to ``log_dir/sglang_<port>.log``. Raises SGLangTimeout when it is not healthy
        within ``startup_timeout_s`` (the process is killed), SGLangError with the log tail when it
        exits early. ``server_module`` lets tests launch the stand-in the same way.
        """
        o = options if options is not None else SGLangLaunchOptions()
        client = client if client is not None else SGLangClientOptions()
        port = int(o.port) if o.port else free_port(o.host)
        log_root = Path(o.log_dir) if o.log_dir is not None else Path(tempfile.mkdtemp(prefix="sglang_logs_"))
        log_root.mkdir(parents=True, exist_ok=True)
        log_path = log_root / f"sglang_{port}.log"
        tp = max(1, len(gpus))
        cmd = [o.python, "-m", o.server_module, *launch_flags(model_path, o, client, tp, port)]
        keys = [k for k in (client.api_key, client.admin_api_key) if k]
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        shown = " ".join("<hidden>" if arg in keys else arg for arg in cmd)
        logger.info("launching SGLang server: %s (GPUs %s, log %s)", shown, list(gpus) or "none", log_path)
        proc = start_process(cmd, log_path, env=env)  # a group of its own: shutdown reaches its scheduler children
        client_host = "127.0.0.1" if o.host in ("0.0.0.0", "") else o.host
        engine = cls(f"http://{client_host}:{port}", client, num_ranks=tp, routing_layout=routing_layout,
                     process=proc, log_path=log_path)
        try:
            engine.wait_healthy(o.startup_timeout_s)
        except BaseException:
            engine.shutdown()
            raise
        logger.info("SGLang server %s is healthy", engine.base_url)
        return engine

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Stop the server process this client launched: SIGTERM (SGLang's server then ends its scheduler and
        detokenizer processes), then after ``timeout_s`` SIGKILL to its whole process group, which also reaches
        children left behind by a server that died."""
        proc, self.process = self.process, None
        stop_process(proc, grace_s=timeout_s)

    def __repr__(self) -> str:
        return f"SGLangEngine({self.base_url!r}, version={self.version})"
