"""The OpenAPI description of the infer routes (the /docs page, and what the schema fuzzing in
tests/test_fuzz_rest.py generates requests from). The parser, `api.tensors`, is what decides:
this says what it accepts, with the same bounds."""

from __future__ import annotations

from typing import Any

from api.tensors import MAX_DIMS, OUTPUT_NAMES

INPUT_NAME = "input"

_ERROR_SCHEMA = {"content": {"application/json": {"example": {"error": "The message is empty."}}}}
_JSON_EXAMPLE = {
    "inputs": [{"name": INPUT_NAME, "shape": [1], "datatype": "BYTES", "data": ["Where is my order?"]}],
    "parameters": {"binary_data_output": False},
}
_DIMENSION = {"type": "integer", "minimum": 1}
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string", "enum": [INPUT_NAME]},
        "shape": {"type": "array", "minItems": 1, "maxItems": MAX_DIMS, "items": _DIMENSION},
        "datatype": {"type": "string", "enum": ["BYTES"]},
        "parameters": {
            "type": "object",
            "properties": {
                "content_type": {"type": "string", "enum": ["str", "base64"]},
                "binary_data_size": {"type": "integer", "minimum": 0},
            },
        },
        "data": {"type": "array", "items": {"type": "string"}},
    },
}
_REQUESTED_OUTPUT = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "enum": list(OUTPUT_NAMES)},
        "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}},
    },
}
INFER_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": _TENSOR},
        "outputs": {"type": "array", "maxItems": len(OUTPUT_NAMES), "items": _REQUESTED_OUTPUT},
        "parameters": {"type": "object", "properties": {"binary_data_output": {"type": "boolean"}}},
    },
}
_BINARY_BODY = {
    "type": "string",
    "format": "binary",
    "description": "Triton's binary tensor extension: the JSON header (Inference-Header-Content-Length "
    "bytes), then the tensor data.",
}
_HEADER_LENGTH = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "description": "With binary tensor data: the JSON header's length in bytes.",
    "schema": {"type": "integer", "minimum": 1},
}
INFER_DOCS: dict[str, Any] = {
    "parameters": [_HEADER_LENGTH],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": INFER_REQUEST_SCHEMA, "example": _JSON_EXAMPLE},
            "application/octet-stream": {"schema": _BINARY_BODY},
        },
    },
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Malformed request or bad input", **_ERROR_SCHEMA},
    404: {"description": "Unknown model or version", **_ERROR_SCHEMA},
    413: {"description": "Request body over the limit", **_ERROR_SCHEMA},
    415: {"description": "Unknown Content-Encoding", **_ERROR_SCHEMA},
    503: {"description": "The model failed", **_ERROR_SCHEMA},
}
