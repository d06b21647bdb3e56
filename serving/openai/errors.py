"""OpenAI-shaped errors: one exception type, one body shape, one handler per failure source.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with
the status OpenAI uses. Nothing a client sends may produce a 500: validation failures,
malformed JSON, unknown routes and engine rejections all map to 4xx here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmkube.serving.engine.errors import EngineDeadError, InvalidRequestError, RequestAbortedError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class ClientDisconnectedError(Exception):
    """The HTTP client went away before the response was complete (nobody to answer)."""


class OpenAIError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def not_ready() -> OpenAIError:
    return OpenAIError(503, "The model is still loading; retry shortly.", type=UNAVAILABLE, code="not_ready")


def engine_dead() -> OpenAIError:
    return OpenAIError(
        503, "The engine has stopped and cannot serve requests.", type=UNAVAILABLE, code="engine_dead"
    )


def overloaded(limit: int) -> OpenAIError:
    return OpenAIError(
        503,
        f"The server is overloaded ({limit} requests in flight); retry shortly.",
        type=UNAVAILABLE,
        code="overloaded",
    )


def from_exception(exc: BaseException) -> OpenAIError:
    """Map any exception raised while serving a request onto an ``OpenAIError``."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, ValidationError):
        return from_validation_errors(exc.errors(include_url=False))
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    if isinstance(exc, ClientDisconnectedError):
        return OpenAIError(499, "The client closed the connection.", code="client_disconnected")
    if isinstance(exc, RequestAbortedError):
        return OpenAIError(503, "The request was aborted by the engine; retry.", type=UNAVAILABLE,
                           code="request_aborted")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return OpenAIError(500, "The server had an error while processing your request.", type=SERVER_ERROR)


# --- pydantic validation errors -> OpenAI messages ------------------------------------------


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """``("messages", 0, "role")`` -> ``messages[0].role``; union/tag branches are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str):
            if part.startswith(("function-", "tagged-union", "union[")) or "[" in part or part in _TYPE_NAMES:
                continue  # pydantic names the union member it tried; not a field
            path += f".{part}" if path else part
    return path or None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "list[str]", "list[int]", "list[list[int]]"}
_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "string": "a string",
    "list": "an array",
    "dict": "an object",
    "model": "an object",
}


def from_validation_errors(errors: list[Any]) -> OpenAIError:
    """Turn pydantic's error list into one OpenAI 400 naming the first offending field."""
    if not errors:
        return bad_request("Invalid request.")
    err = errors[0]
    kind: str = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = _param_path(loc)
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
            "using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
            code="invalid_json",
        )
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind in {"model_type", "model_attributes_type", "dict_type"} and not param:
        return bad_request("The request body must be a JSON object.", None, "invalid_type")
    for word, article in _TYPE_WORDS.items():
        if kind.startswith(word + "_") and kind.endswith("_type"):
            return bad_request(
                f"Invalid type for '{param}': expected {article}, but got {_describe(err.get('input'))} instead.",
                param,
                "invalid_type",
            )
    if kind in {"int_parsing", "float_parsing", "bool_parsing", "int_from_float"}:
        return bad_request(
            f"Invalid type for '{param}': {err.get('msg', '').lower()}, got {_describe(err.get('input'))}.",
            param,
            "invalid_type",
        )
    if kind == "too_short" and err.get("input") == []:
        return bad_request(
            f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty "
            "array instead.",
            param,
            "empty_array",
        )
    if kind in {"greater_than_equal", "less_than_equal", "greater_than", "less_than", "too_short", "too_long"}:
        return bad_request(f"Invalid '{param}': {err.get('msg', '').lower()}.", param, "invalid_value")
    if kind == "literal_error":
        return bad_request(f"Invalid value for '{param}': {err.get('msg', '')}.", param, "invalid_value")
    return bad_request(f"Invalid value for '{param}': {err.get('msg', 'invalid value')}.", param, "invalid_value")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# --- FastAPI wiring -----------------------------------------------------------------------


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=headers)


async def _openai_error_handler(_: Request, exc: Exception) -> JSONResponse:
    return error_response(from_exception(exc))


async def _request_validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(from_validation_errors(list(exc.errors())))


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err = OpenAIError(404, f"Unknown request URL: {request.method} {request.url.path}.", type=NOT_FOUND,
                          code="unknown_url")
    elif exc.status_code == 405:
        err = OpenAIError(405, f"Method {request.method} is not allowed for {request.url.path}.",
                          code="method_not_allowed")
    else:
        err = OpenAIError(exc.status_code, str(exc.detail),
                          type=INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR)
    return error_response(err, headers=getattr(exc, "headers", None))


async def _unexpected_handler(_: Request, exc: Exception) -> JSONResponse:
    return error_response(from_exception(exc))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error path of ``app`` answer in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(InvalidRequestError, _openai_error_handler)
    app.add_exception_handler(EngineDeadError, _openai_error_handler)
    app.add_exception_handler(ValidationError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
