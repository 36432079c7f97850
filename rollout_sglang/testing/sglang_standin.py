"""A stand-in for an SGLang server on loopback, backed by the local engine (tests, CPU runs).

SGLang cannot run on this project's CPU machines, so the SGLang client
(:class:`rollout_sglang.engines.sglang_client.SGLangEngine`) and the weight sync are exercised against
this server. Every request is first checked against **SGLang's own request definitions** of the
pinned version (:mod:`rollout_sglang.testing.sglang_contract`, read from the SGLang wheel: the
``io_struct.py`` request classes, ``api/v1`` ``GenerateRequest``/``SamplingParams`` and the
routes of ``http_server.py``), with one rule stricter than SGLang: a field SGLang does not know is
refused (SGLang would drop it silently). Then it follows SGLang's behaviour:

* ``POST /generate`` with ``input_ids`` (one list or a batch), ``sampling_params`` (one dict or one
  per prompt), ``return_logprob``; answers one object (or a list for a batch) ``{"text",
  "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id} | {"type":
  "length", "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens",
  "output_token_logprobs": [[logprob, token_id, null], ...], "weight_version", "weight_versions",
  "e2e_latency"}}``. ``weight_versions`` are SGLang 0.5.23's spans ``[{"version", "start", "end"}, ...]`` over
  output token positions (``srt/utils/weight_versions.py``): the scheduler's version string that sampled each
  run of tokens (a request no update crossed: one span; one with no tokens: one empty span of the version then
  served), ``weight_version`` the last span's (:func:`weight_version_spans`).
  With ``return_logprob``, ``meta_info.input_token_logprobs`` too, from ``logprob_start_len`` L (one, or one per
  prompt) as SGLang 0.5.23 resolves and builds it: -1, the default, gives ``[]`` (output tokens only); L in
  ``[0, len(prompt)]`` gives one ``[logprob, token_id, null]`` per position ``[L, len(prompt))``, the first's
  log-prob null (its logits are not computed), the others' untempered log-prob given the tokens before
  (:meth:`LocalEngine.score`), a token id ``>= vocab_size - 1`` reported as 0; L past the prompt is HTTP 400 with
  the scheduler's message. ``max_new_tokens: 0`` with it is how a sequence is scored
  (:meth:`SGLangEngine.score <rollout_sglang.engines.sglang_client.SGLangEngine.score>`).
  With ``deterministic`` (``--enable-deterministic-inference``) a row without ``sampling_seed``
  samples with seed 42, as SGLang's sampler does. MoE models: ``"return_routed_experts": true`` with
  ``routed_experts_start_len`` (one start for the whole request, in ``[0, len(prompt)]`` of every row, else
  HTTP 400 with the scheduler's message) adds ``meta_info.routed_experts``, base64 of the int32
  ``[positions, num_hidden_layers, top_k]`` array of positions ``[start, seqlen - 1)`` (dense layers 0), from
  the local engine's recorded routing; only with ``capture_routing`` (``--enable-return-routed-experts``):
  without it the key is absent and nothing else changes, as in SGLang.
* The weight update: ``/init_weights_update_group`` (every simulated TP rank joins at ``rank_offset
  + tp_rank``; with ``lazy_join``, the default, the group's collectives start only at the first
  update request, as SGLang's NCCL communicator does, so a trainer that waits for the group first
  hangs), ``/begin_weight_update`` and ``/end_weight_update`` (one session at a time; a second begin
  is refused), ``/update_weights_from_distributed`` (refused outside a session; ``load_format
  "flattened_bucket"``: one broadcast of raw bytes, else one broadcast per tensor; with
  ``flush_cache`` true it loads the weights, then fails, as SGLang's updater does, when the scheduler is not
  idle: requests running, or held by an ``in_place`` pause), ``/destroy_weights_update_group``. Each answers
  ``{"success", "message"}``, HTTP 400 when ``success`` is false. The group rendezvous uses the
  store layout of SGLang's ``init_custom_process_group``. An update's ``weight_version`` becomes the
  scheduler's version as its last bucket lands (``record_weight_version_change``: the spans of requests it
  crossed split there), and ``/model_info``'s once the call succeeds (the tokenizer manager's).
* ``/pause_generation {"mode"}``: while paused, new ``/generate`` requests wait before they reach the engine
  (SGLang's tokenizer manager holds them); ``abort`` stops admitting (see the differences below);
  ``in_place`` and ``retract`` hold the running requests between two tokens (:meth:`LocalEngine.pause`), to
  continue after ``/continue_generation`` over their KV cache as it was (``in_place``) or recomputed with the
  weights then loaded (``retract``). ``/continue_generation`` (accepted when not paused, as in SGLang).
  ``/flush_cache``: refused (400) unless SGLang's scheduler would be idle (``is_fully_idle(ignore_waiting=
  paused)``): no request admitted, or a pause that left none in the running batch (``retract`` moves them to the
  waiting queue, which a paused scheduler ignores; ``abort`` aborts them); with ``?timeout=`` it first waits that
  long for no request to be left. ``/health``, ``/health_generate`` (as SGLang's: a paused server answers it 503
  after 20 s), ``/model_info``, ``/server_info`` (``tp_size``, ``pp_size``, ``dp_size``).
* LoRA (``--enable-lora`` and its flags): ``/load_lora_adapter {lora_name, lora_path, pinned}`` loads a PEFT
  directory, ``/unload_lora_adapter {lora_name}`` unloads one (after the requests that use it), each answering
  ``{"success", "error_message", "loaded_adapters"}`` (HTTP 400 when not a success); ``lora_path`` on
  ``/generate`` (a name, or one name or null per prompt) picks each row's adapter; SGLang's names, limits, TP
  slicing and error texts (:mod:`rollout_sglang.testing.standin_lora`). ``/load_lora_adapter_from_tensors`` is
  not served: its tensors are torch ``ForkingPickler`` handles to the sender's shared memory or CUDA IPC, which
  SGLang opens only on the sender's host, and the project's client never sends it.
* Keys: ``api_key`` and ``admin_api_key`` with SGLang's per-endpoint rules (health probes open;
  ``ADMIN_OPTIONAL`` endpoints take the admin key when one is set).

Known differences from SGLang (this is a stand-in, not an emulator): TP ranks are threads that each
receive every broadcast (rank 0's copy is loaded, the others are checked equal to it); no radix
cache (a flush drops nothing, so ``in_place`` requests after an update never reuse old-weights KV of other
requests, as SGLang's can until the cache is flushed or evicted); in an ``abort`` pause, tensors sent one per
broadcast are received straight into the engine's parameters (SGLang receives into buffers and then loads);
in an ``in_place`` or ``retract`` pause they are received into buffers and loaded under the engine's lock,
after the held requests' current decode step; an ``abort`` pause never aborts a generation already running
(the local engine finishes it, and a flush counts it as aborted; SGLang aborts it and answers
``finish_reason`` abort); a ``retract`` pause recomputes a held request's KV in the same call, without
``meta_info.num_retractions``; versions are told apart by the local engine's int version, so an update whose
``weight_version`` is not a number (the project's client never sends one) keeps that int, and the spans name
the new string for the tokens of both; text prompts, streaming, stop strings, penalties and constrained
decoding are refused with HTTP 400. Extensions, which real SGLang does not have:
``/server_info`` lists ``agentrl_extensions``; ``/update_weights_from_distributed`` accepts
``agentrl_checksum`` and ``agentrl_send_recv_tag`` (the trainer side of both is
:class:`rollout_sglang.testing.transport.StandInTransport`); ``POST /agentrl/raw_broadcast
{nbytes, group_name}`` receives one raw buffer (the benchmark's baseline). Test hooks:
:meth:`StandInServer.stall` makes every request hang (client timeouts); ``refuse_destroy`` makes
``/destroy_weights_update_group`` fail and keep the group, as when torch's destroy fails; two faults of an
in-flight update, off by default and set as flags of the process (:class:`StandInOptions`):
``--test-sigkill-on-pause N`` (the process SIGKILLs itself right after answering the Nth ``/pause_generation``
that finds requests running) and ``--test-hold-update N`` (the Nth ``/begin_weight_update`` answers
``--test-hold-update-s`` seconds after it opened the session). ``/server_info`` also reports the stand-in's state:
``paused``, ``pause_mode``, ``running_requests`` (``/generate`` requests in the engine, held ones included) and
``weight_update_session`` (a session is open).

Run as a process with SGLang's command line: ``python -m rollout_sglang.testing.sglang_standin
--model-path DIR --host 127.0.0.1 --port 30000 [--tp-size N] [--api-key K] [--admin-api-key K]
[--enable-deterministic-inference] [--enable-lora --max-lora-rank R --lora-target-modules M ...
--max-loras-per-batch N --max-loaded-loras N] [--test-sigkill-on-pause N] [--test-hold-update N
--test-hold-update-s S]`` (other SGLang flags are accepted and ignored).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from aiohttp import web

from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.sglang_server_args import server_flags
from rollout_sglang.testing.sglang_contract import Contract, ContractError, load_contract
from rollout_sglang.testing.standin_lora import LoraRefused, LoraServing
from rollout_sglang.testing.standin_options import StandInOptions
from rollout_sglang.testing.transport import CHECKSUM_FIELD, EXT_CHECKSUM, EXT_SEND_RECV, TAG_FIELD, StandInReceive
from rollout_sglang.weight_update.receiver import BucketReceiver

logger = logging.getLogger(__name__)

EXTENSIONS = [EXT_CHECKSUM, "raw_broadcast", EXT_SEND_RECV]
#: SGLang's ``HEALTH_CHECK_TIMEOUT`` (``entrypoints/http_server.py``): how long ``/health_generate`` waits for output
HEALTH_CHECK_TIMEOUT_S = 20.0
# request fields of the stand-in's extensions (SGLang would ignore them silently; the stand-in reads them)
EXTENSION_FIELDS = frozenset({CHECKSUM_FIELD, TAG_FIELD})

# SGLang sampling keys: those the stand-in honours, and those it accepts only at their defaults
_SUPPORTED_SP = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed",
                 "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens", "ignore_eos"}
_DEFAULT_ONLY_SP = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "min_new_tokens": 0, "n": 1, "stop": None, "json_schema": None, "regex": None, "ebnf": None,
                    "structural_tag": None, "custom_params": None, "logit_bias": None, "stream_interval": None}


class BadRequest(ValueError):
    """A request the stand-in (or SGLang) refuses with HTTP 400."""


def _sampling_params(sp: dict[str, Any]) -> tuple[SamplingParams, int | None]:
    """SGLang sampling_params dict -> (SamplingParams without seed, sampling_seed)."""
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - _SUPPORTED_SP - set(_DEFAULT_ONLY_SP))
    if unknown:
        raise BadRequest(f"unknown sampling parameter(s) {unknown}")
    for k, default in _DEFAULT_ONLY_SP.items():
        if k in sp and sp[k] not in (default, None if default is None else default):
            raise BadRequest(f"sampling parameter {k}={sp[k]!r} is not supported by the stand-in (only {default!r})")
    seed = sp.get("sampling_seed")
    params = SamplingParams(
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=int(sp.get("top_k", -1)),
        stop_token_ids=[int(t) for t in (sp.get("stop_token_ids") or [])],
        seed=None,
    )
    return params, None if seed is None else int(seed)


def weight_version_spans(token_names: list[str], current: str) -> list[dict[str, Any]]:
    """SGLang 0.5.23's ``meta_info.weight_versions`` of one finished request whose output tokens were sampled by
    the versions named ``token_names`` (one string per token), ``current`` the scheduler's version now.

    The semantics of the wheel's ``compute_weight_version_spans`` and ``add_weight_versions_to_meta_info``
    (``srt/utils/weight_versions.py``): one span ``{"version", "start", "end"}`` per run of tokens of one version,
    over output positions ``[start, end)``; a request with no tokens gets one empty span of ``current``.
    """
    spans: list[dict[str, Any]] = []
    for i, name in enumerate(token_names):
        if spans and spans[-1]["version"] == name:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": name, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def _ok(message: str) -> web.Response:
    return web.json_response({"success": True, "message": message})


def _fail(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=status)


class _EngineWeights(Mapping):
    """A local engine's weights by Hugging Face name, as writable views (``LocalEngine.weight_target``)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._engine.weight_target(name)[1].data

    def __iter__(self) -> Iterator[str]:
        return iter(self._engine.model.state_dict(keep_vars=True))

    def __len__(self) -> int:
        return len(self._engine.model.state_dict(keep_vars=True))


class StandInServer:
    """An SGLang-shaped HTTP server for one :class:`LocalEngine`, on its own thread and event loop.

    engine: the engine that generates and receives weights.
    options: where it listens and the SGLang flags it mirrors (:class:`StandInOptions`); ``url`` after
        :meth:`start`.
    contract: the SGLang request contract every request is checked against (None: the pinned
        version's, :func:`rollout_sglang.testing.sglang_contract.load_contract`).
    """

    def __init__(self, engine: LocalEngine, options: StandInOptions | None = None, *,
                 contract: Contract | None = None) -> None:
        o = self.options = options if options is not None else StandInOptions()
        if o.capture_routing and getattr(engine, "routing_layout", None) is None:
            raise ValueError(f"capture_routing (--enable-return-routed-experts) needs a MoE model; "
                             f"{type(engine.model).__name__} is dense")
        self.capture_routing = o.capture_routing
        self.engine = engine
        self.host = o.host
        self.port = int(o.port)
        self.model_path = o.model_path
        self.tp_size = int(o.tp_size)
        self.receivers = [BucketReceiver(lazy_join=o.lazy_join) for _ in range(self.tp_size)]
        self.receiver = self.receivers[0]
        self.group_timeout_s = float(o.group_timeout_s)
        self.deterministic = o.deterministic
        self.api_key, self.admin_api_key = o.api_key, o.admin_api_key
        self.contract = contract if contract is not None else load_contract()
        self.refuse_destroy = False  # test hook: /destroy_weights_update_group fails and keeps the group
        self.bodies: list[tuple[str, Any]] = []  # (path, JSON body) of every request, in order (for tests)
        # SGLang's --weight-version defaults to "default": a fresh server reports no version of ours. This is the
        # tokenizer manager's (``/model_info``), set when an update call succeeds
        self.weight_version = "default" if o.weight_version is None else str(o.weight_version)
        # the scheduler's, set as an update's last bucket lands (even when its flush then fails), and the version
        # string of each int version of the engine, to name the versions of a request's tokens
        self._scheduler_version = self.weight_version
        self._version_names: dict[int, str] = {int(engine.version): self.weight_version}
        self.requests: list[str] = []  # endpoints served, in order (for tests)
        self.update_log: list[str] = []  # one line per weight-update request (for tests)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stalled = threading.Event()
        self._stopping = threading.Event()
        self._update_open = False
        self._param_views: Mapping[str, torch.Tensor] | None = None
        self._update_lock: asyncio.Lock | None = None
        self._paused = False
        self._pause_mode: str | None = None  # the mode of the current pause (None: not paused)
        self._admitting: asyncio.Event | None = None  # set while not paused: /generate requests reach the engine
        self._session_open = False  # SGLang's weight-update session (begin/end_weight_update)
        self._pending_version: int | None = None  # stamped on the engine when its open update closes
        self._running = 0  # /generate requests being served
        self._holding_pauses = 0  # /pause_generation calls that found requests running (the SIGKILL hook counts)
        self._begins = 0  # /begin_weight_update calls that opened a session (the hold hook counts)
        self.lora = LoraServing(engine, o, self.tp_size)
        self._lora_lock: asyncio.Lock | None = None
        self.unload_wait_s = float(o.unload_wait_s)

    # --------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve on a background thread; returns the URL once listening (RuntimeError after ``timeout_s``)."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"standin-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"stand-in server did not start within {timeout_s:.0f}s")
        if errors:
            raise RuntimeError(f"stand-in server failed to start: {errors[0]!r}") from errors[0]
        return self.url

    async def _serve(self) -> None:
        self._update_lock = asyncio.Lock()
        self._lora_lock = asyncio.Lock()
        self._admitting = asyncio.Event()
        self._admitting.set()
        app = web.Application(middlewares=[self._middleware], client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_post("/init_weights_update_group", self._init_group)
        r.add_post("/update_weights_from_distributed", self._update)
        r.add_post("/destroy_weights_update_group", self._destroy_group)
        r.add_post("/begin_weight_update", self._begin_update)
        r.add_post("/end_weight_update", self._end_update)
        r.add_post("/pause_generation", self._pause)
        r.add_post("/continue_generation", self._continue)
        r.add_get("/flush_cache", self._flush_cache)
        r.add_post("/flush_cache", self._flush_cache)
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health_generate)
        r.add_get("/model_info", self._model_info)
        r.add_get("/get_model_info", self._model_info)
        r.add_get("/server_info", self._server_info)
        r.add_get("/v1/models", self._models)
        r.add_get("/get_server_info", self._server_info)
        r.add_post("/agentrl/raw_broadcast", self._raw_broadcast)
        r.add_post("/load_lora_adapter", self._load_lora)
        r.add_post("/unload_lora_adapter", self._unload_lora)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock).start()
        logger.info("SGLang stand-in (SGLang %s contract) serving %s on %s", self.contract.pin, self.model_path,
                    self.url)

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (pending requests are cancelled) and leave every weight-sync group."""
        self._stopping.set()
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
        self.receiver.close()

    def __enter__(self) -> "StandInServer":
        """Started for the block, stopped after it."""
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stall(self, stalled: bool = True) -> None:
        """Test hook: while stalled, every request hangs without an answer (clients must time out)."""
        if stalled:
            self._stalled.set()
        else:
            self._stalled.clear()

    # -------------------------------------------------------------- plumbing
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append(request.path)
        while self._stalled.is_set() and not self._stopping.is_set():
            await asyncio.sleep(0.05)
        if self._stopping.is_set():
            return web.Response(status=503, text="stand-in is shutting down")
        if not self._authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            if request.path in self.contract.paths:
                body = await self._json(request) if request.body_exists else None
                self.bodies.append((request.path, body))
                self.contract.check_request(request.path, body, method=request.method,
                                            allow_extra=EXTENSION_FIELDS)
            return await handler(request)
        except ContractError as e:
            # FastAPI answers a body its request class refuses with 422; /generate's contract gate with 400
            return web.json_response({"error": {"message": str(e)}}, status=400 if request.path == "/generate" else 422)
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)

    def _authorized(self, request: web.Request) -> bool:
        """SGLang's key rules: health probes are open; ADMIN_OPTIONAL endpoints take the admin key when
        one is set (else the API key); every other endpoint takes the API key when one is set."""
        path = request.path
        if path.startswith(("/health", "/ready", "/metrics")):
            return True
        admin = path in self.contract.paths and self.contract.auth_level(path) == "ADMIN_OPTIONAL"
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        if not key:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, key)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if not request.body_exists:  # (can_read_body turns False once the middleware read it)
            return {}
        try:
            body = await request.json()
        except ValueError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on a daemon thread (a receive stuck on a dead trainer never blocks exit)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(result: Any, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def run() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
                result, error = None, e
            try:
                loop.call_soon_threadsafe(deliver, result, error)
            except RuntimeError:  # the loop is closed: the server stopped
                pass

        threading.Thread(target=run, name="standin-work", daemon=True).start()
        return await fut

    # ------------------------------------------------------------- generation
    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the stand-in")
        # GenerateReqInput fields the api/v1 gate does not know: SGLang honours them, the stand-in only this one
        route = self.contract.route("/generate")
        gate = set(self.contract.data["classes"][route["request"]]["fields"])
        unsupported = sorted(set(body) - gate - EXTENSION_FIELDS - {"return_routed_experts"})
        if unsupported:
            raise BadRequest(f"request fields {unsupported} are not supported by the stand-in")
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("the stand-in needs input_ids (it runs like --skip-tokenizer-init); text is not supported")
        single = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], int)
        prompts: list[list[int]] = [ids] if single else ids
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
            raise BadRequest("input_ids must be a non-empty list of token ids or a list of such lists")
        n = len(prompts)
        sp_raw = body.get("sampling_params") or {}
        sps = sp_raw if isinstance(sp_raw, list) else [sp_raw] * n
        if len(sps) != n:
            raise BadRequest(f"{len(sps)} sampling_params for {n} prompts")
        parsed = [_sampling_params(sp) for sp in sps]
        if self.deterministic:  # SGLang's sampler takes seed 42 for a row without one
            parsed = [(p, 42 if seed is None else seed) for p, seed in parsed]
        want_lp = body.get("return_logprob")
        want_lp = [bool(x) for x in want_lp] if isinstance(want_lp, list) else [bool(want_lp)] * n
        rid = body.get("rid")
        rids = rid if isinstance(rid, list) else [f"{rid}_{i}" if rid else uuid.uuid4().hex for i in range(n)]
        routing_from = self._routing_start(body, prompts)
        lp_starts = self._logprob_starts(body, prompts, want_lp)
        assert self._lora_lock is not None and self._admitting is not None
        await self._admitting.wait()  # SGLang's tokenizer manager holds new requests while paused
        async with self._lora_lock:
            try:
                adapters = await self._blocking(self.lora.resolve, body.get("lora_path"), n)
            except LoraRefused as e:
                raise BadRequest(str(e)) from None
            for name in set(adapters or []) - {None}:
                self.lora.in_use[name] = self.lora.in_use.get(name, 0) + 1

        t0 = time.perf_counter()
        self._running += 1
        outs: list[Any] = [None] * n
        inputs: list[list[list[Any]] | None] = [None] * n  # each row's input_token_logprobs (None: not asked)
        groups: dict[tuple, list[int]] = {}
        for i, (p, _) in enumerate(parsed):
            key = (p.max_new_tokens, p.temperature, p.top_p, p.top_k, tuple(p.stop_token_ids))
            groups.setdefault(key, []).append(i)
        try:
            await self._input_logprobs(prompts, lp_starts, adapters, inputs)
            for rows in groups.values():
                params = parsed[rows[0]][0]
                seeds = [parsed[r][1] for r in rows]  # SGLang's per-request sampling_seed: the engine's per-row seeds
                kwargs: dict[str, Any] = {}
                if any(s is not None for s in seeds):
                    kwargs["seeds"] = seeds
                if routing_from is not None:
                    kwargs["routing_from"] = [routing_from] * len(rows)
                if adapters is not None and any(adapters[r] is not None for r in rows):
                    kwargs["adapters"] = [adapters[r] for r in rows]
                res = await self.engine.generate([prompts[r] for r in rows], params, **kwargs)
                for r, o in zip(rows, res):
                    outs[r] = (o, params)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        finally:
            self._running -= 1
            for name in set(adapters or []) - {None}:
                self.lora.in_use[name] -= 1
        dt = time.perf_counter() - t0
        items = []
        for i, (o, _) in enumerate(outs):
            if o.finish_reason == "stop":
                fr = {"type": "stop", "matched": o.token_ids[-1]}
            else:
                fr = {"type": "length", "length": len(o.token_ids)}
            if adapters is not None and adapters[i] is not None:  # an adapter's version is not the scheduler's
                names = [self._scheduler_version] * len(o.token_ids)
            else:
                names = [self._version_names.get(int(v), str(v)) for v in o.token_versions]
            spans = weight_version_spans(names, self._scheduler_version)
            meta: dict[str, Any] = {
                "id": rids[i], "finish_reason": fr, "prompt_tokens": len(prompts[i]),
                "completion_tokens": len(o.token_ids), "cached_tokens": 0,
                "weight_version": spans[-1]["version"], "weight_versions": spans, "e2e_latency": dt,
            }
            if want_lp[i]:
                meta["input_token_logprobs"] = inputs[i] if inputs[i] is not None else []
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.logprobs, o.token_ids)]
            if routing_from is not None:
                meta["routed_experts"] = self._routed_experts_b64(o.routed_experts)
            items.append({"text": "", "output_ids": list(o.token_ids), "meta_info": meta})
        return web.json_response(items[0] if single else items)

    def _logprob_starts(self, body: dict[str, Any], prompts: list[list[int]], want_lp: list[bool]) -> list[int]:
        """Each row's first input position with log-probs, as SGLang 0.5.23's scheduler resolves
        ``logprob_start_len`` (``Scheduler._handle_generate_request``): a row without ``return_logprob`` ignores it
        (none: the prompt's length); -1, the default (``GenerateReqInput``'s normalization), means output tokens
        only (the prompt's length); a start past the prompt aborts the request, which the HTTP server answers with
        400 and the scheduler's message. A start below -1 is refused (SGLang leaves it undefined)."""
        raw = body.get("logprob_start_len")
        n = len(prompts)
        asked = raw if isinstance(raw, list) else [-1 if raw is None else raw] * n
        if len(asked) != n:
            raise BadRequest(f"{len(asked)} logprob_start_len for {n} prompts")
        out = []
        for p, want, start in zip(prompts, want_lp, asked):
            start = int(start)
            if not want or start == -1:
                out.append(len(p))
                continue
            if start < -1:
                raise BadRequest(f"logprob_start_len={start} is not supported by the stand-in (use -1 or a position)")
            if start > len(p):
                raise BadRequest(f"req.logprob_start_len={start} is higher than the number of input tokens "
                                 f"len(req.origin_input_ids)={len(p)}. Please use a smaller logprob_start_len.")
            out.append(start)
        return out

    async def _input_logprobs(self, prompts: list[list[int]], starts: list[int], adapters: list[str | None] | None,
                              inputs: list[Any]) -> None:
        """Fill ``inputs[i]`` with row ``i``'s ``meta_info.input_token_logprobs`` when its start is inside its prompt,
        as SGLang 0.5.23 builds them (``SchedulerLogprobResultProcessor._process_input_token_logprobs``): one
        ``[logprob, token_id, None]`` per input position from the start on, the start's own log-prob None (its
        logits are not computed), each other position's untempered log-prob given the tokens before it
        (:meth:`LocalEngine.score`), a token id ``>= vocab_size - 1`` reported as 0. Rows of an adapter are refused
        (the engine scores the base)."""
        rows = [i for i, (p, s) in enumerate(zip(prompts, starts)) if s < len(p)]
        if not rows:
            return
        if adapters is not None and any(adapters[i] is not None for i in rows):
            raise BadRequest("input log-probs (logprob_start_len) of a LoRA adapter's rows are not supported by the "
                             "stand-in")
        scored = await self.engine.score([prompts[i] for i in rows], [starts[i] + 1 for i in rows])
        vocab = int(self.engine.vocab_size)
        for i, lps in zip(rows, scored):
            s, p = starts[i], prompts[i]
            inputs[i] = [[None if t == s else lps[t], p[t] if p[t] < vocab - 1 else 0, None] for t in range(s, len(p))]

    def _routing_start(self, body: dict[str, Any], prompts: list[list[int]]) -> int | None:
        """The start to ask the engine's routing from, None when none is returned: SGLang returns routing only
        when the request asks (``return_routed_experts``) and the server captures (else it drops the ask
        without a word); it aborts a request whose ``routed_experts_start_len`` is outside ``[0, len(prompt)]``
        (scheduler.py), which the HTTP server answers with 400 and the message."""
        if not body.get("return_routed_experts"):
            return None
        start = int(body.get("routed_experts_start_len", 0))
        if start < 0:
            raise BadRequest(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                             "routed_experts_start_len.")
        for p in prompts:
            if start > len(p):
                raise BadRequest(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                                 f"tokens len(req.origin_input_ids)={len(p)}. Please use a smaller "
                                 "routed_experts_start_len.")
        return start if self.capture_routing else None

    def _routed_experts_b64(self, record: np.ndarray | None) -> str:
        """A record of the MoE layers as SGLang sends it: its capturer's int32 host buffer rows ``[positions,
        num_hidden_layers, top_k]`` (a layer without a router is never written: zeros), base64 of the raw bytes
        (detokenizer_manager.py ``_b64_encode_per_request``)."""
        layout = self.engine.routing_layout
        assert record is not None and layout is not None
        full = np.zeros((record.shape[0], layout.num_layers, layout.top_k), dtype=np.int32)
        full[:, list(layout.moe_layers), :] = record
        return base64.b64encode(full.tobytes()).decode("utf-8")

    # ------------------------------------------------------------------- LoRA
    def _lora_answer(self, error: str | None = None) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: HTTP 200 on success, 400 with ``error_message`` when refused."""
        return web.json_response({"success": error is None, "error_message": error,
                                  "loaded_adapters": self.lora.loaded()}, status=200 if error is None else 400)

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        assert self._lora_lock is not None
        async with self._lora_lock:
            try:
                await self._blocking(self.lora.load, str(body["lora_name"]), str(body["lora_path"]),
                                     bool(body.get("pinned", False)))
            except LoraRefused as e:
                return self._lora_answer(str(e))
        return self._lora_answer()

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = str(body["lora_name"])
        assert self._lora_lock is not None
        async with self._lora_lock:
            # SGLang waits for the requests that use the adapter before it unloads it
            engine_name = self.lora.registry[name].engine_name if name in self.lora.registry else None
            deadline = time.monotonic() + self.unload_wait_s
            while engine_name and self.lora.in_use.get(engine_name, 0) > 0:
                if time.monotonic() > deadline:
                    return self._lora_answer(f"LoRA adapter {name} is still in use after {self.unload_wait_s:.0f}s")
                await asyncio.sleep(0.01)
            try:
                await self._blocking(self.lora.unload, name)
            except LoraRefused as e:
                return self._lora_answer(str(e))
        return self._lora_answer()

    # ---------------------------------------------------------- pause / flush
    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        assert self._admitting is not None
        # abort: stop admitting (the version pool drained the engine); in_place / retract: hold running requests
        self.engine.pause(None if mode == "abort" else mode)
        self._paused, self._pause_mode = True, mode
        self._admitting.clear()
        answer = web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if self._running:
            self._holding_pauses += 1
            if self._holding_pauses == self.options.sigkill_on_pause:  # 0 (off) never matches
                await self._answer_then_die(request, answer, f"paused ({mode}) holding {self._running} requests")
        return answer

    async def _answer_then_die(self, request: web.Request, answer: web.Response, state: str) -> None:
        """Test hook: send ``answer`` (into the kernel's socket buffer, which outlives the process), then SIGKILL
        this process, as an engine that crashes or is killed: no cleanup, every connection dropped."""
        await answer.prepare(request)
        await answer.write_eof()
        logger.warning("test hook: SIGKILL on the %s while %s", request.path, state)
        os.kill(os.getpid(), signal.SIGKILL)

    async def _continue(self, request: web.Request) -> web.Response:
        await self._json(request)
        assert self._admitting is not None
        self.engine.resume()
        self._paused, self._pause_mode = False, None
        self._admitting.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _scheduler_idle(self) -> bool:
        """Whether SGLang's scheduler would flush now (``is_fully_idle(ignore_waiting=paused)``): no admitted
        request, or a pause that left none in the running batch (``abort`` aborted them, ``retract`` moved them to
        the waiting queue, which a paused scheduler ignores); ``in_place`` keeps them running."""
        return self._running == 0 or (self._paused and self._pause_mode != "in_place")

    async def _flush_cache(self, request: web.Request) -> web.Response:
        """As SGLang: refused (400) unless the scheduler is idle (:meth:`_scheduler_idle`); with ``?timeout=``
        seconds, SGLang's deferred flush first waits that long for no request to be left."""
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            raise BadRequest(f"timeout={request.query.get('timeout')!r} must be a number of seconds") from None
        if timeout > 0 and self._running:
            deadline = time.monotonic() + timeout
            while self._running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self._running:
                return web.Response(status=400, text="Timed out waiting for idle state.")
        if not self._scheduler_idle():
            return web.Response(status=400, text="Flush cache failed: requests are still running or queued.\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    # ---------------------------------------------------------------- weights
    async def _init_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            args = (str(body["master_address"]), int(body["master_port"]), int(body["rank_offset"]),
                    int(body["world_size"]), str(body.get("group_name", "weight_update_group")),
                    str(body.get("backend", "nccl")))
        except (KeyError, TypeError, ValueError) as e:
            return _fail(f"Failed to init process group: bad request field {e!r}")
        if args[5] == "nccl" and not torch.cuda.is_available():
            return _fail("Failed to init process group: backend 'nccl' needs CUDA, which this engine lacks; use 'gloo'")
        master, port, offset, world, name, backend = args

        def join(tp_rank: int) -> None:  # SGLang: every TP rank joins at rank_offset + tp_rank
            self.receivers[tp_rank].init_group(master, port, offset + tp_rank, world, name, backend,
                                               self.group_timeout_s)

        try:
            await asyncio.gather(*(self._blocking(join, r) for r in range(self.tp_size)))
        except Exception as e:  # noqa: BLE001 - reported to the client
            logger.error("init_weights_update_group failed: %s", e)
            return _fail(f"Failed to initialize custom process group: {e}.")
        return _ok("Succeeded to initialize custom process group.")

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        name = str(body.get("group_name", "weight_update_group"))
        if self.refuse_destroy:
            return _fail(f"Failed to destroy custom process group {name!r} (test hook: the group stays registered).")
        try:
            for receiver in self.receivers:
                await self._blocking(receiver.destroy_group, name)
        except KeyError as e:
            return _fail(str(e))
        return _ok("Succeeded to destroy custom process group.")

    async def _begin_update(self, request: web.Request) -> web.Response:
        if self._session_open:
            return _fail("a weight-update session is already open; call end_weight_update() first")
        self._session_open = True
        self._begins += 1
        if self.options.hold_update and self._begins == self.options.hold_update:
            logger.warning("test hook: update %d's session is open (paused: %s, %d requests running); answering in "
                           "%.1fs", self._begins, self._pause_mode, self._running, self.options.hold_update_s)
            await asyncio.sleep(self.options.hold_update_s)
        return _ok("Success")

    async def _end_update(self, request: web.Request) -> web.Response:
        if not self._session_open:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        assert self._update_lock is not None
        async with self._update_lock:
            if self._update_open:  # tensors loaded through the engine's update: close it
                self.engine.end_weight_update()
                self._update_open = False
            if self._pending_version is not None:
                self.engine.version, self._pending_version = self._pending_version, None
        self._session_open = False
        return _ok("Success")

    def _load(self, pairs: list[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Load received tensors into the engine; a ``weight_version`` becomes the scheduler's.

        In an ``abort`` pause (nothing generates), tensors are copied straight into the parameters;
        otherwise through the engine's weight update (under its lock), which
        ``/end_weight_update`` closes.
        """
        views = self._in_place_targets()
        if pairs and views is not None and not self._update_open:
            for name, t in pairs:
                dst = views.get(name)
                if dst is None:
                    raise KeyError(f"unknown parameter name {name!r}; weights must use Hugging Face names")
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"shape mismatch for {name!r}: engine has {tuple(dst.shape)}, "
                                     f"received {tuple(t.shape)}")
                dst.copy_(t)
            pairs = []
        if pairs:
            if not self._update_open:
                self.engine.begin_weight_update(self.engine.version, {})
                self._update_open = True
            self.engine.receive_bucket(pairs)
        if weight_version is not None:
            stamp = int(weight_version) if weight_version.isdigit() else None  # the engine's version is an int
            self._record_version_change(weight_version, self.engine.version if stamp is None else stamp)
            if stamp is not None and not self._update_open:
                self.engine.version = stamp
            elif stamp is not None:
                self._pending_version = stamp

    def _record_version_change(self, new: str, engine_version: int) -> None:
        """SGLang's ``record_weight_version_change``: ``new`` is the scheduler's version from now on (no change when
        it already is); the tokens the engine samples at ``engine_version`` are named ``new``."""
        self._version_names[int(engine_version)] = new
        if new == self._scheduler_version:
            return
        old, self._scheduler_version = self._scheduler_version, new
        logger.info("Weight version changed. old_version=%r new_version=%r num_running=%d", old, new, self._running)

    def _in_place_targets(self) -> Mapping[str, torch.Tensor] | None:
        """The engine's parameters by HF name (one expert of a fused MoE tensor included), to receive
        per-tensor buckets into directly.

        Only in an ``abort`` pause: the version pool drains a slot before pausing it, so no generation
        reads the weights while they change. Otherwise (no pause, or an ``in_place`` / ``retract`` pause, whose
        held requests may still be in a decode step) tensors are received into buffers and loaded under the
        engine's lock.
        """
        if not self._paused or self._pause_mode != "abort":
            return None
        if self._param_views is None:
            self._param_views = _EngineWeights(self.engine)
        return self._param_views

    async def _update(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), list(body["shapes"])
        except (KeyError, TypeError) as e:
            return _fail(f"Failed to update parameter online: missing or bad field {e!r} (need names, dtypes, shapes)")
        group = str(body.get("group_name", "weight_update_group"))
        load_format = body.get("load_format")
        version = body.get("weight_version")
        if not self._session_open:
            return _fail("update_weights_from_distributed must run between begin_weight_update() and "
                         "end_weight_update()")
        try:
            transports = [StandInReceive(body.get(TAG_FIELD), body.get(CHECKSUM_FIELD), names)
                          for _ in range(self.tp_size)]
        except ValueError as e:
            return _fail(f"Failed to update parameter online: {e}")
        assert self._update_lock is not None

        arrived = time.time()

        def receive_other(tp_rank: int) -> list[tuple[str, torch.Tensor]]:
            return [(n, t.clone()) for n, t in self.receivers[tp_rank].receive(
                names, dtypes, shapes, group, load_format, transport=transports[tp_rank])]

        def work() -> None:
            started = time.time()
            copies: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []
            others = [threading.Thread(target=lambda r=r: copies.append((r, receive_other(r))), daemon=True)
                      for r in range(1, self.tp_size)]
            for t in others:
                t.start()
            pairs = self.receiver.receive(names, dtypes, shapes, group, load_format, into=self._in_place_targets(),
                                          transport=transports[0])
            for t in others:
                t.join(self.group_timeout_s)
            self._check_tp_copies(names, pairs, copies)
            received = time.time()
            self._load(pairs, None if version is None else str(version))
            how = transports[0].how
            self.update_log.append(f"{len(names)} tensors ({load_format or 'per tensor'}, {how})")
            logger.debug("update of %d tensors (%s, %s): arrived %.3f, started +%.1f ms, received +%.1f ms, "
                         "loaded +%.1f ms", len(names), load_format or "per tensor", how, arrived,
                         1e3 * (started - arrived), 1e3 * (received - arrived), 1e3 * (time.time() - arrived))

        async with self._update_lock:
            try:
                await self._blocking(work)
            except Exception as e:  # noqa: BLE001 - reported to the client
                logger.error("update_weights_from_distributed failed: %s", e)
                return _fail(f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                             "partially updated. Please discard the whole weights.")
            if body.get("flush_cache", True) and not self._scheduler_idle():
                # SGLang's flush_cache_after_weight_update: the weights and the scheduler's version stay updated
                return _fail("Weights were updated, but the cache was not flushed because requests are still running "
                             "or queued. Retract or finish them, then call /flush_cache.")
        if version is None:
            return _ok("Succeeded to update parameter online.")
        self.weight_version = str(version)  # the tokenizer manager's, on success only
        return _ok(f"Succeeded to update parameter online. Weight version updated to {version}.")

    def _check_tp_copies(self, names: list[str], pairs: list[tuple[str, torch.Tensor]],
                         copies: list[tuple[int, list[tuple[str, torch.Tensor]]]]) -> None:
        """Every simulated TP rank must have received the bucket, byte for byte what rank 0 received."""
        if len(copies) != self.tp_size - 1:
            got = sorted(r for r, _ in copies)
            raise RuntimeError(f"TP ranks {sorted(set(range(1, self.tp_size)) - set(got))} did not receive the bucket")
        views = self._in_place_targets() or {}
        rank0 = dict(pairs)
        for rank, received in copies:
            for name, t in received:
                ref = rank0.get(name, views.get(name))
                if ref is None or not torch.equal(ref.view(t.shape), t):
                    raise RuntimeError(f"TP rank {rank} received other bytes than rank 0 for {name!r}")

    async def _raw_broadcast(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        assert self._update_lock is not None

        def work(nbytes: int, group: str) -> float:
            # one flat uint8 bucket: a single broadcast into the group's reused receive buffer
            [(_, buf)] = self.receiver.receive(["raw"], ["uint8"], [[nbytes]], group, "flattened_bucket")
            return float(buf[: min(nbytes, 1024)].sum())

        async with self._update_lock:
            try:
                probe = await self._blocking(work, int(body["nbytes"]),
                                             str(body.get("group_name", "weight_update_group")))
            except Exception as e:  # noqa: BLE001
                return _fail(f"raw broadcast failed: {e}")
        return web.json_response({"success": True, "message": "received", "probe": probe})

    # ----------------------------------------------------------------- status
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _health_generate(self, request: web.Request) -> web.Response:
        """SGLang's ``/health_generate``: a one-token generation, which a paused server does not serve: it answers
        503 after ``HEALTH_CHECK_TIMEOUT`` (20 s) without output."""
        deadline = time.monotonic() + HEALTH_CHECK_TIMEOUT_S
        while self._paused:
            if time.monotonic() >= deadline:
                return web.Response(status=503)
            await asyncio.sleep(0.05)
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": None, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
        })

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "version": f"agentrl-standin (SGLang {self.contract.pin} API)", "model_path": self.model_path,
            "tp_size": self.tp_size, "pp_size": 1, "dp_size": 1, "agentrl_standin": True,
            "agentrl_extensions": EXTENSIONS,
            "weight_version": self.weight_version, "paused": self._paused, "pause_mode": self._pause_mode,
            "running_requests": self._running, "weight_update_session": self._session_open,
            **self.options.other_server_args,
        })


    async def _models(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /v1/models`` (``http_server.py`` ``available_models``): the base's model card, then one per
        loaded LoRA adapter (``id`` its name, ``root`` its path, ``parent`` the base)."""
        cards = [{"id": self.model_path, "object": "model", "owned_by": "sglang", "root": self.model_path,
                  "parent": None}]
        if self.lora.flags.enable_lora:
            cards += [{"id": name, "object": "model", "owned_by": "sglang", "root": path, "parent": self.model_path}
                      for name, path in self.lora.loaded().items()]
        return web.json_response({"object": "list", "data": cards})


def _other_sglang_flags(parser: argparse.ArgumentParser, tokens: list[str]) -> dict[str, Any]:
    """The SGLang flags among ``tokens`` that the stand-in does not implement, by SGLang's field name to their
    text (a switch: True); a flag that the pinned SGLang does not have either ends the process as SGLang's parser
    would (exit status 2, ``unrecognized arguments``)."""
    flags = server_flags()
    out: dict[str, Any] = {}
    unknown = []
    i = 0
    while i < len(tokens):
        flag, _, inline = tokens[i].partition("=")
        entry = flags.get(flag) if flag.startswith("--") else None
        i += 1
        if entry is None:
            unknown.append(tokens[i - 1])
            continue
        if entry["kind"] != "value":
            out[entry["dest"]] = not flag.startswith("--no-") or flag == entry["flags"][0]
            continue
        values = [inline] if inline else []
        while not inline and i < len(tokens) and not tokens[i].startswith("--"):
            values.append(tokens[i])
            i += 1
        out[entry["dest"]] = values if entry["nargs"] in ("+", "*") else (values[0] if values else None)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m rollout_sglang.testing.sglang_standin --model-path DIR [--host H] [--port P] [SGLang flags]``."""
    parser = argparse.ArgumentParser(description="SGLang stand-in server backed by the local engine (CPU)")
    parser.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--admin-api-key", default=None)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--weight-version", default=None, help="the version the server reports (default: 'default')")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="answer return_routed_experts (MoE models), as SGLang's flag")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters, as SGLang's flag")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-loaded-loras", type=int, default=None)
    parser.add_argument("--test-sigkill-on-pause", type=int, default=0, metavar="N",
                        help="test hook: SIGKILL this process right after answering the Nth /pause_generation that "
                             "finds requests running (0: off)")
    parser.add_argument("--test-hold-update", type=int, default=0, metavar="N",
                        help="test hook: the Nth /begin_weight_update answers --test-hold-update-s seconds after it "
                             "opened the session (0: off)")
    parser.add_argument("--test-hold-update-s", type=float, default=10.0, metavar="S")
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    others = _other_sglang_flags(parser, unknown)
    if others:
        logger.warning("ignoring SGLang flags the stand-in does not implement: %s", " ".join(unknown))
    dtype = "float32" if args.dtype in ("auto", "float", "float32") else args.dtype
    engine = LocalEngine.from_pretrained(args.model_path, dtype=dtype, device="cpu")
    server = StandInServer(engine, StandInOptions(
        host=args.host, port=args.port, model_path=args.model_path, tp_size=args.tp_size,
        deterministic=args.enable_deterministic_inference, api_key=args.api_key, admin_api_key=args.admin_api_key,
        weight_version=args.weight_version, capture_routing=args.enable_return_routed_experts,
        enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
        max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras,
        sigkill_on_pause=args.test_sigkill_on_pause, hold_update=args.test_hold_update,
        hold_update_s=args.test_hold_update_s, other_server_args=others))
    server.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    logger.info("stand-in ready on %s", server.url)
    done.wait()
    server.stop()


if __name__ == "__main__":
    main()
