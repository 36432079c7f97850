"""``agentrl controller`` and ``agentrl worker``: the env controller and a task worker as processes.

::

    agentrl controller --host 127.0.0.1 --port 5020
    agentrl worker --task lookup --controller http://127.0.0.1:5020/api --port 5021
    agentrl worker --task mypkg.tasks:MyTask --param seed=1 --concurrency 256 ...
    agentrl worker --task os_shell --param backend=docker --max-containers 250 --warm-containers 0:16 ...

Also runnable without the console script: ``python -m env_controller.cli controller ...``.
A non-loopback ``--host`` needs credentials: ``--token`` (or ``$AGENTRL_CONTROLLER_TOKEN``) for
every role, or ``--trainer-token`` with ``--worker-token NAME=TOKEN`` / ``--worker-tokens-file``.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
import logging
import sys
import typing
from typing import Any, TypeVar

from env_controller.http.auth import (
    TOKEN_ENV,
    TRAINER_TOKEN_ENV,
    WORKER_TOKEN_ENV,
    resolve_token,
    split_url_credentials,
)
from env_controller.http.service import install_uvloop, raise_nofile_limit
from env_controller.options import field_types

logger = logging.getLogger("agentrl.env")
T = TypeVar("T")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _error(message: str) -> int:
    sys.stderr.write(f"agentrl: error: {message}\n")
    return 2


#: a flag that sets one field of an options class: (flag, field, help); its type and default are the field's
Flag = tuple[str, str, str]

#: where a server listens and its request and connection limits (:class:`~env_controller.http.options.ServerOptions`)
SERVER_FLAGS: tuple[Flag, ...] = (
    ("--host", "host", "address to bind (elsewhere than loopback needs --token)"),
    ("--port", "port", "port to bind (0 picks a free one)"),
    ("--body-timeout", "body_timeout_s", "seconds a client may take to send a request body"),
    ("--idle-timeout", "idle_timeout_s", "seconds a connection may wait for a complete request head"),
    ("--max-connections", "max_connections", "client connections open at once; one more is answered 503"),
)
#: ``agentrl controller``'s flags of :class:`~env_controller.controller.options.ControllerConfig`
CONTROLLER_FLAGS: tuple[Flag, ...] = (
    *SERVER_FLAGS,
    ("--heartbeat-timeout", "heartbeat_timeout_s", "seconds without heartbeat before a worker is dead"),
    ("--suspect-after", "suspect_after_s", "seconds without heartbeat before a worker gets no new sessions"),
    ("--session-idle-timeout", "session_idle_timeout_s", "seconds without interact before a session is closed"),
    ("--interact-timeout", "interact_timeout_s", "limit on one worker interact call, seconds"),
    ("--start-timeout", "start_timeout_s", "limit on one worker start_sample call, seconds"),
)
#: ``agentrl worker``'s flags of :class:`~env_controller.worker.options.WorkerOptions`
WORKER_FLAGS: tuple[Flag, ...] = (
    ("--name", "name", "task name announced to the controller (default: the task's name)"),
    ("--controller", "controller_url", "controller API URL"),
    *SERVER_FLAGS,
    ("--self-address", "self_address", "URL the controller reaches this worker at (default http://<host>:<port>/api)"),
    ("--heartbeat-interval", "heartbeat_interval_s", "seconds between heartbeats"),
    ("--timeout", "timeout_s", "limit on each task call, seconds"),
)
#: where ``agentrl worker`` differs from the library's defaults: it heartbeats to a local controller by default
WORKER_CLI_DEFAULTS = {"controller_url": "http://127.0.0.1:5020/api", "port": 5021}


def add_option_flags(p: argparse.ArgumentParser, cls: type, flags: tuple[Flag, ...],
                     defaults: dict[str, Any] | None = None) -> None:
    """Add ``flags`` to ``p``, each setting a field of the options class ``cls`` (``dest`` the field's name), with
    the field's type and default (or this command's, from ``defaults``), which its help shows."""
    hints = field_types(cls)
    declared = {f.name: f.default for f in dataclasses.fields(cls)}
    for flag, name, text in flags:
        default = (defaults or {}).get(name, declared[name])
        kinds = [t for t in typing.get_args(hints[name]) if t is not type(None)] or [hints[name]]
        shown = f" (default {default:g})" if isinstance(default, float) else (
            f" (default {default})" if default is not None else "")
        p.add_argument(flag, dest=name, type=kinds[0], default=default, help=text + shown,
                       metavar=flag.lstrip("-").replace("-", "_").upper())


def options_from_args(cls: type[T], args: argparse.Namespace, flags: tuple[Flag, ...], **derived: Any) -> T:
    """``cls`` from the parsed values of ``flags`` plus the ``derived`` fields (those no single flag sets)."""
    return cls(**{name: getattr(args, name) for _, name, _ in flags}, **derived)


def add_controller_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl controller``."""
    from env_controller.controller.options import ControllerConfig

    add_option_flags(p, ControllerConfig, CONTROLLER_FLAGS)
    p.add_argument("--token", default=None, help=f"shared token: the trainer's and every worker's credential, for "
                   f"the roles not given their own below (default ${TOKEN_ENV})")
    p.add_argument("--trainer-token", default=None,
                   help=f"the trainer's credential: start, interact, cancel, views (default ${TRAINER_TOKEN_ENV})")
    p.add_argument("--worker-token", action="append", default=[], metavar="NAME=TOKEN",
                   help="a worker credential and the task it may serve (NAME '*' = any task); repeatable")
    p.add_argument("--worker-tokens-file", default=None, metavar="PATH",
                   help="YAML mapping of task name (or '*') to worker token, read like --worker-token")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl worker``."""
    from env_controller.worker.options import WorkerOptions

    p.add_argument(
        "--task", required=True, help="a registered task (lookup, calc, guess, ...) or module.path:TaskClass"
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task constructor parameter (value parsed as YAML); repeatable",
    )
    add_option_flags(p, WorkerOptions, WORKER_FLAGS, WORKER_CLI_DEFAULTS)
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"open sessions allowed (default {WorkerOptions.concurrency}, or --max-containers when "
                        "given; never more than it)")
    p.add_argument("--max-containers", type=int, default=None, metavar="N",
                   help="sandboxes (containers) this worker may hold live at once, warm ones included; sets the "
                        "task's max_containers param (tasks with sandboxes, e.g. os_shell)")
    p.add_argument("--warm-containers", default=None, metavar="N|MIN:MAX",
                   help="sandboxes started ahead of demand: N, or between MIN and MAX by the last 30 s of demand; "
                        "sets the task's warm_containers param")
    p.add_argument(
        "--latency-ms", type=float, default=0.0, help="simulated extra latency per start/interact, ms (benchmarks)"
    )
    p.add_argument(
        "--token", default=None,
        help=f"the worker's credential: sent to the controller, required from it (default: the password of the "
             f"--controller URL, else ${WORKER_TOKEN_ENV}, else ${TOKEN_ENV})",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def build_worker_task(spec: str, params: list[str]) -> Any:
    """Build the task of ``agentrl worker``: a registered name or ``module:Class``, with ``KEY=VALUE`` params.

    Raises ValueError naming a bad spec or parameter.
    """
    import yaml

    from env_controller.options import Options, build_options
    from env_controller.tasks import build_task

    kwargs: dict[str, Any] = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r} must be KEY=VALUE, e.g. --param seed=1")
        kwargs[key] = yaml.safe_load(value)
    if ":" not in spec:
        return build_task(spec, **kwargs)
    module_name, _, cls_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--task {spec!r}: cannot import {module_name!r}: {e}") from None
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ValueError(f"--task {spec!r}: module {module_name!r} has no {cls_name!r}")
    options = getattr(cls, "Options", None)
    try:
        if isinstance(options, type) and issubclass(options, Options):  # a task written on TaskOptions
            return cls(build_options(options, kwargs, cls_name))
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"--task {spec!r}: {e}") from None


def pool_params(args: argparse.Namespace) -> list[str]:
    """``--param`` items for ``--max-containers`` / ``--warm-containers``; ValueError when the task has no
    sandbox pool to apply them to."""
    from env_controller.sandbox.options import parse_warm

    items = []
    if args.max_containers is not None:
        if args.max_containers < 1:
            raise ValueError(f"--max-containers {args.max_containers} must be a positive integer")
        items.append(f"max_containers={args.max_containers}")
    if args.warm_containers is not None:
        parse_warm(args.warm_containers, "--warm-containers")
        items.append(f"warm_containers='{args.warm_containers}'")
    if items and ":" not in args.task:
        from env_controller.tasks import TASKS

        cls = TASKS.get(args.task)
        if cls is not None and not hasattr(cls, "sandbox_pool"):
            raise ValueError(f"--max-containers / --warm-containers: task {args.task!r} runs no sandboxes; they "
                             "apply to tasks with a sandbox pool (os_shell)")
    return items


def worker_tokens(items: list[str], path: str | None) -> dict[str, str]:
    """Task name (or ``*``) to worker token, from ``NAME=TOKEN`` items and a YAML file; ValueError
    naming the bad entry (never a token)."""
    import yaml

    out: dict[str, str] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--worker-tokens-file {path!r}: cannot read it: {type(e).__name__}") from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in loaded.items()
        ):
            raise ValueError(f"--worker-tokens-file {path!r} must be a YAML mapping of task name (or '*') to a "
                             "token string, e.g. 'lookup: 3f9c...'")
        out.update(loaded)
    for item in items:
        name, sep, token = item.partition("=")
        if not sep or not name or not token:  # never echo the item: without '=' it may be a bare token
            raise ValueError("--worker-token: an entry is not NAME=TOKEN (NAME a task name, or '*' for any task)")
        out[name] = token
    return out


def controller(args: argparse.Namespace) -> int:
    """Run the controller until SIGINT/SIGTERM (``agentrl controller``)."""
    from env_controller.controller.options import ControllerConfig
    from env_controller.controller.server import serve_controller

    _setup_logging(args.log_level)
    try:
        config = options_from_args(
            ControllerConfig, args, CONTROLLER_FLAGS, token=resolve_token(args.token),
            trainer_token=resolve_token(args.trainer_token, TRAINER_TOKEN_ENV),
            worker_tokens=worker_tokens(args.worker_token, args.worker_tokens_file),
        )
        from env_controller.http.auth import check_bind

        check_bind(config.host, config.credentials().enabled, "the controller")
    except ValueError as e:
        return _error(str(e))
    uv = install_uvloop()
    raise_nofile_limit()
    logger.info("event loop: %s", "uvloop" if uv else "asyncio")
    try:
        asyncio.run(serve_controller(config))
    except OSError as e:
        return _error(f"cannot serve on {args.host}:{args.port}: {e}")
    return 0


def worker(args: argparse.Namespace) -> int:
    """Run a task worker until SIGINT/SIGTERM (``agentrl worker``)."""
    from env_controller.http.auth import check_bind
    from env_controller.http.service import settle_gc, wait_for_signal
    from env_controller.worker.options import WorkerOptions
    from env_controller.worker.server import WorkerServer

    _setup_logging(args.log_level)
    # precedence: --token, then credentials in the URL (the server warns when both are given), then the environment
    _, url_token = split_url_credentials(args.controller_url)
    token = args.token or None
    if token is None and url_token is None:
        token = resolve_token(None, WORKER_TOKEN_ENV, TOKEN_ENV)
    try:
        check_bind(args.host, token or url_token, "the worker")
        task = build_worker_task(args.task, args.param + pool_params(args))
        concurrency = args.concurrency if args.concurrency is not None else args.max_containers
        server = WorkerServer(task, options_from_args(
            WorkerOptions, args, WORKER_FLAGS, latency_s=args.latency_ms / 1000.0, token=token,
            **({"concurrency": concurrency} if concurrency is not None else {}),
        ))
    except ValueError as e:
        return _error(str(e))
    install_uvloop()
    raise_nofile_limit()

    async def run() -> None:
        try:
            await server.start()
            settle_gc()  # as the controller: no full collector passes over the sessions while they are served
            try:
                await wait_for_signal()
            finally:
                await server.stop()
        finally:
            # the task's sandboxes (a pool's warm ones too) go with the worker, not at the next start
            close = getattr(task, "close", None)
            if inspect.iscoroutinefunction(close):
                await close()
            elif callable(close):
                await asyncio.get_running_loop().run_in_executor(None, close)

    from env_controller.sandbox import SandboxError

    try:
        asyncio.run(run())
    except SandboxError as e:
        return _error(f"the task's sandboxes cannot start: {e}")
    except OSError as e:
        return _error(f"cannot serve on {args.host}:{args.port}: {e}")
    return 0


def register(sub: Any) -> None:
    """Add the ``controller`` and ``worker`` subcommands to an argparse subparsers object."""
    p = sub.add_parser("controller", help="run the environment controller (AgentRL task-worker protocol)")
    add_controller_arguments(p)
    p.set_defaults(func=controller)
    p = sub.add_parser("worker", help="serve a task to a controller over the AgentRL task-worker protocol")
    add_worker_arguments(p)
    p.set_defaults(func=worker)


def main(argv: list[str] | None = None) -> int:
    """``python -m env_controller.cli {controller,worker} ...``."""
    parser = argparse.ArgumentParser(prog="python -m env_controller.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
