"""OpenAPI 3 descriptions of the controller's API and of the worker server's API.

Built from Python (no data files to ship) and served by each server at ``GET /openapi.json``;
``tests/env/test_http_openapi.py`` fuzzes both servers from them with schemathesis.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

from env_controller.openapi._schemas import (
    AUTH_ERRORS,
    BODY_ERRORS,
    INDEX,
    SESSION_ID_HEADER,
    document,
    error,
    json_body,
    ok,
    ref,
    reply_schema,
)

__all__ = ["controller_spec", "worker_spec"]

#: a session id in a body: an integer, or its decimal string (AgentRL's pydantic models accept both)
SESSION_ID = {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^-?[0-9]{1,30}$"}]}


def _header(name: str, required: bool = True) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": required, **SESSION_ID_HEADER}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": {**responses, **AUTH_ERRORS}, **extra}


def _metrics_and_description(metrics_summary: str) -> dict[str, Any]:
    """The paths both servers have: ``/metrics`` (Prometheus) and ``/openapi.json`` (this description)."""
    return {
        "/metrics": {"get": _op(metrics_summary, {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        })},
        "/openapi.json": {"get": {"summary": "This description (no credential)", "security": [{}],
                                  "responses": {"200": ok({"type": "object"})}}},
    }


@functools.cache
def _controller() -> dict[str, Any]:
    timing = {
        name: {"schema": {"type": "string"}, "description": desc}
        for name, desc in (
            ("x-controller-overhead-ms", "the controller's own time on the request"),
            ("x-worker-time-ms", "the worker's own time"),
            ("x-worker-rtt-ms", "the round trip to the worker"),
        )
    }
    reply = ref("ControllerReply")
    start_body = {
        "type": "object",
        "required": ["name", "index"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "description": "the task name"},
            "index": INDEX,
            "custom_task": {"type": "object", "nullable": True, "description": "passed on to the worker"},
        },
    }
    heartbeat_body = {
        "type": "object",
        "required": ["name", "address", "concurrency", "indices"],
        "properties": {
            "name": {"type": "string", "pattern": "^[^\\x00-\\x1f\\x7f]{1,200}$"},
            "address": {"type": "string", "pattern": "^http://[!-~]+$", "description": "the worker's API URL"},
            "concurrency": {"type": "integer", "minimum": 1},
            "indices": {"type": "array", "items": INDEX},
        },
    }
    worker_view = {
        "type": "object",
        "required": ["id", "name", "address", "concurrency", "current", "state"],
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "address": {"type": "string"},
            "concurrency": {"type": "integer"},
            "current": {"type": "integer"},
            "state": {"type": "string", "enum": ["alive", "suspect", "dead"]},
            "reason": {"type": "string"},
            "last_heartbeat_s_ago": {"type": "number"},
            "heartbeats": {"type": "integer"},
            "registered_at": {"type": "number"},
        },
    }
    session_view = {
        "type": "object",
        "required": ["name", "index", "worker_id", "busy", "turns"],
        "properties": {
            "name": {"type": "string"},
            "index": INDEX,
            "worker_id": {"type": "integer"},
            "start": {"type": "number"},
            "idle_s": {"type": "number"},
            "busy": {"type": "boolean"},
            "turns": {"type": "integer"},
        },
    }
    paths = {
        "/api/start_sample": {"post": _op(
            "Start an episode of a task sample on the least-loaded worker (trainer credential)",
            {
                "200": ok(reply, "the first reply; a finished one with 'error' when the episode failed at once",
                          {"session_id": {**SESSION_ID_HEADER, "required": True}, **timing}),
                **BODY_ERRORS,
                "404": error("unknown task"),
                "503": error("no free worker; nothing happened, retry later",
                             {"Retry-After": {"schema": {"type": "string"}}}),
            },
            requestBody=json_body(start_body),
        )},
        "/api/interact": {"post": _op(
            "Send the assistant message of one turn (trainer credential)",
            {
                "200": ok(reply, "the task's reply; a finished one with 'error' when the controller ended it",
                          {"session_id": SESSION_ID_HEADER, **timing}),
                **BODY_ERRORS,
                "404": error("unknown or ended session"),
                "409": error("the session's previous interact is still running"),
            },
            parameters=[_header("session_id")],
            requestBody=json_body({"type": "object", "required": ["messages"],
                                   "properties": {"messages": ref("Messages")}}),
        )},
        "/api/cancel": {"post": _op(
            "End a session (trainer credential)",
            {
                "200": ok({"type": "object", "required": ["session_id", "status"], "properties": {
                    "session_id": {"type": "integer"}, "status": {"type": "string"}, "detail": {"type": "string"}}}),
                "400": error("missing or malformed session_id header"),
                "404": error("unknown session"),
            },
            parameters=[_header("session_id")],
        )},
        "/api/list_workers": {"get": _op("Workers by task (trainer credential)", {"200": ok({
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["indices", "workers"],
                "properties": {"indices": {"type": "integer"},
                               "workers": {"type": "object", "additionalProperties": worker_view}},
            },
        })})},
        "/api/list_sessions": {"get": _op("Open sessions by id (trainer credential)", {"200": ok({
            "type": "object", "additionalProperties": session_view})})},
        "/api/get_indices": {"get": _op(
            "A task's sample indices (trainer credential)",
            {"200": ok({"type": "array", "items": INDEX}), "400": error("missing 'name'"),
             "404": error("unknown task")},
            parameters=[{"name": "name", "in": "query", "required": True,
                         "schema": {"type": "string", "minLength": 1}}],
        )},
        "/api/health": {"get": _op("Liveness and counts (any credential)", {"200": ok({
            "type": "object",
            "required": ["status", "workers_alive", "workers", "sessions"],
            "properties": {"status": {"type": "string"}, "workers_alive": {"type": "integer"},
                           "workers": {"type": "integer"}, "sessions": {"type": "integer"}},
        })})},
        "/api/receive_heartbeat": {"post": _op(
            "Register a worker, or keep it registered (worker credential allowed for the task name)",
            {
                "200": ok({"type": "object", "required": ["worker_id", "state"], "properties": {
                    "worker_id": {"type": "integer"}, "state": {"type": "string"}}}),
                **BODY_ERRORS,
                "409": error("the task is served by live workers with other indices"),
            },
            requestBody=json_body(heartbeat_body),
        )},
        "/api/cancel_notice": {"post": _op(
            "A worker cancelled a session on its own (worker credential)",
            {
                "200": ok({"type": "object", "required": ["session_id"],
                           "properties": {"session_id": {"type": "integer"}}}),
                **BODY_ERRORS,
            },
            parameters=[_header("session_id", required=False)],
            requestBody=json_body({"type": "object", "properties": {"session_id": SESSION_ID}}, required=False),
        )},
        **_metrics_and_description("Prometheus metrics (trainer credential)"),
    }
    return document(
        "agentrl env controller",
        "Between the trainer and task workers, wire-compatible with the AgentBench-FC / AgentRL task-worker "
        "protocol. Errors are {error, status}; a 5xx means nothing happened.",
        paths,
        {"ControllerReply": reply_schema("metrics")},
    )


#: ``/api/worker_status``'s ``sandbox_pool`` (a task whose sessions hold containers; see sandbox/pool.py)
SANDBOX_POOL = {
    "type": "object",
    "description": "the worker's pool of sandboxes: sizes now, the settings, and counters since it started",
    "required": ["backend", "max", "live", "leased", "idle"],
    "properties": {
        "backend": {"type": "string"}, "reuse": {"type": "boolean"},
        **{k: {"type": "integer", "minimum": 0} for k in (
            "max", "warm_min", "warm_max", "warm_target", "live", "peak_live", "leased", "idle", "starting",
            "resetting", "removing", "waiting")},
        "acquire_s": {"type": "object", "description": "seconds to get a sandbox (warm, cold): percentiles"},
    },
}


@functools.cache
def _worker() -> dict[str, Any]:
    reply = ref("WorkerReply")
    worker_time = {"x-worker-time": {"schema": {"type": "string"}, "description": "seconds spent on the request"}}
    sid_body = {"type": "object", "required": ["session_id"], "properties": {"session_id": SESSION_ID}}
    sid_reply = ok({"type": "object", "required": ["session_id"], "properties": {"session_id": {"type": "integer"}}})
    no_session = {**BODY_ERRORS, "400": error("malformed body, or no such session")}
    paths = {
        "/api/start_sample": {"post": _op(
            "Start an episode",
            {
                "200": ok(reply, "the first reply", {"session_id": {**SESSION_ID_HEADER, "required": True},
                                                     **worker_time}),
                **BODY_ERRORS,
                "400": error("malformed body, duplicate session id, or unknown index"),
                "406": error("at concurrency"),
            },
            requestBody=json_body({
                "type": "object",
                "required": ["index", "session_id"],
                "properties": {"index": INDEX, "session_id": SESSION_ID,
                               "custom_task": {"type": "object", "nullable": True}},
            }),
        )},
        "/api/interact": {"post": _op(
            "One turn of an open session",
            {
                "200": ok({"type": "object", "required": ["session_id", "env_out"], "properties": {
                    "session_id": {"type": "integer"}, "env_out": reply}}, headers=worker_time),
                **no_session,
                "400": error("malformed body, no such session, or a call still running"),
            },
            requestBody=json_body({"type": "object", "required": ["session_id", "messages"],
                                   "properties": {"session_id": SESSION_ID, "messages": ref("Messages")}}),
        )},
        "/api/cancel": {"post": _op("End a session", {"200": sid_reply, **no_session},
                                    requestBody=json_body(sid_body))},
        "/api/cancel_with_notice": {"post": _op("End a session, then tell the controller",
                                                {"200": sid_reply, **no_session}, requestBody=json_body(sid_body))},
        "/api/cancel_all": {"post": _op("End every session", {"200": ok({
            "type": "object", "required": ["cancelled"],
            "properties": {"cancelled": {"type": "array", "items": {"type": "integer"}}}})})},
        "/api/sample_status": {"post": _op("One session's state", {
            "200": ok({"type": "object", "required": ["session_id", "index", "status"], "properties": {
                "session_id": {"type": "integer"}, "index": INDEX, "status": {"type": "object"}}}),
            **no_session}, requestBody=json_body(sid_body))},
        "/api/get_indices": {"get": _op("The task's sample indices", {"200": ok({"type": "array", "items": INDEX})})},
        "/api/get_sessions": {"get": _op("Open sessions: id to index", {"200": ok({
            "type": "object", "additionalProperties": INDEX})})},
        "/api/worker_status": {"get": _op("Load", {"200": ok({
            "type": "object", "required": ["concurrency", "current"],
            "properties": {"concurrency": {"type": "integer"}, "current": {"type": "integer"},
                           "sandbox_pool": SANDBOX_POOL}})})},
        **_metrics_and_description("Prometheus metrics"),
    }
    return document(
        "agentrl task worker",
        "One task behind the AgentBench-FC / AgentRL task-worker API; the controller calls it with the worker's "
        "own token.",
        paths,
        {"WorkerReply": reply_schema("metric")},
    )


def controller_spec() -> dict[str, Any]:
    """The OpenAPI 3 description of the controller's API (a fresh copy)."""
    return copy.deepcopy(_controller())


def worker_spec() -> dict[str, Any]:
    """The OpenAPI 3 description of the worker server's API (a fresh copy)."""
    return copy.deepcopy(_worker())
