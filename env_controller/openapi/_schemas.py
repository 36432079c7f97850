"""JSON schemas shared by the OpenAPI descriptions of the controller and of the worker server."""
from __future__ import annotations

from typing import Any

from env_controller.http.json_io import MAX_JSON_DEPTH
from env_controller.http.service import MAX_BODY_BYTES
from env_controller.protocol import SampleStatus

JSON = "application/json"


def ref(name: str) -> dict[str, Any]:
    """A reference to ``#/components/schemas/<name>``."""
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or null (OpenAPI 3.0)."""
    return {**schema, "nullable": True}


INDEX = {"oneOf": [{"type": "integer"}, {"type": "string"}], "description": "a sample index, as the task lists it"}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error", "status"],
        "properties": {
            "error": {"type": "string", "description": "what is wrong and how to fix it"},
            "status": {"type": "integer"},
        },
    },
    "ToolCall": {
        "type": "object",
        "required": ["function"],
        "properties": {
            "id": {"type": "string", "minLength": 1},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "arguments": nullable({"oneOf": [{"type": "string"}, {"type": "object"}]}),
                },
            },
        },
    },
    "AssistantMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": nullable({"type": "string"}),
            "tool_calls": nullable({"type": "array", "items": ref("ToolCall")}),
        },
    },
    "Messages": {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": ref("AssistantMessage"),
        "description": "the one assistant message of this turn (OpenAI chat format)",
    },
}


def reply_schema(metrics_key: str) -> dict[str, Any]:
    """A flat task reply; the controller calls the metrics ``metrics``, AgentRL workers ``metric``."""
    return {
        "type": "object",
        "required": ["messages", "tools", "status", "finish", "reward", metrics_key],
        "properties": {
            "messages": {"type": "array", "items": {"type": "object"}, "description": "new chat messages"},
            "tools": {"type": "array", "items": {"type": "object"}, "description": "OpenAI function schemas"},
            "status": {"type": "string", "enum": [s.value for s in SampleStatus]},
            "finish": {"type": "boolean"},
            "reward": {"type": "number"},
            metrics_key: {"type": "object", "additionalProperties": {"type": "number"}},
            "error": {"type": "string", "description": "why the controller ended the session (when it did)"},
        },
    }


def error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """An error response: ``{"error": ..., "status": ...}``."""
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


def ok(schema: dict[str, Any], description: str = "OK", headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A 200 JSON response."""
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def json_body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """A JSON request body."""
    return {"required": required, "content": {JSON: {"schema": schema}}}


#: the errors every authenticated operation may answer
AUTH_ERRORS = {
    "401": error("no credential, or a wrong one", {"WWW-Authenticate": {"schema": {"type": "string"}}}),
    "403": error("a credential of the wrong role (a worker's on the trainer API, or the reverse)"),
}

#: the errors every operation that reads a body may answer
BODY_ERRORS = {
    "400": error(f"malformed body or field (JSON nested deeper than {MAX_JSON_DEPTH} levels included)"),
    "408": error("the body did not arrive within the body timeout; the connection is closed"),
    "413": error(f"the body is over {MAX_BODY_BYTES} bytes (or, forwarded, over the worker's limit)"),
}

SESSION_ID_HEADER = {"schema": {"type": "string", "pattern": "^-?[0-9]{1,30}$"}, "description": "the session id"}

SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "basic": {"type": "http", "scheme": "basic", "description": "the token as password (stock AgentRL workers)"},
}


def document(title: str, description: str, paths: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI 3.0 document."""
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": "1", "description": description},
        "paths": paths,
        "components": {"schemas": {**SCHEMAS, **schemas}, "securitySchemes": SECURITY_SCHEMES},
        "security": [{"bearer": []}, {"basic": []}, {}],
    }
