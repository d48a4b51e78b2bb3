"""Open Inference Protocol v2 tensors on the wire: JSON, and Triton's binary extension.

A body is a JSON header, optionally followed by raw tensor bytes. With raw bytes the
`Inference-Header-Content-Length` header gives the JSON's length and each binary tensor
names its size in `parameters.binary_data_size`, in the order the tensors are listed.
BYTES elements in binary form are a 4-byte little-endian length, then the bytes; FP32
is little-endian IEEE 754.

This module knows nothing of models or the cache: it turns a body into an `InferRequest`
and output tensors into a body, and says precisely what is wrong with a malformed one
(RequestRefused 400).

Hostile bodies cost bounded work: what the caller controls is bounded before any work
proportional to it is done. The JSON's count of values before it is parsed (MAX_JSON_VALUES),
integers while it is parsed (MAX_INT_DIGITS), a shape's dimensions before they are multiplied
(MAX_DIMS, each at most the element limit, the product checked as it grows), binary elements
as they are split, and every value quoted in a message (`api.errors.quote`).
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pybase64

from api.body import byte_count
from api.errors import RequestRefused, quote

OUTPUT_NAMES = ("label", "score")
_CONTENT_TYPES = (None, "str", "base64")
_LENGTH = struct.Struct("<I")
# Dimensions of an input's shape: TensorRT's Dims::MAX_DIMS, the most any Triton backend takes.
# A BYTES batch here is [N] or [N, 1]; the cap keeps the product a handful of multiplications.
MAX_DIMS = 8
# Digits of an integer in the JSON. Every integer a request holds (a dimension, a byte count)
# fits 64 bits, 20 digits, as orjson takes them; the standard parser (the fallback) refuses a
# longer one at once instead of converting thousands of digits (quadratic) or failing on
# Python's 4,300-digit limit.
MAX_INT_DIGITS = 20
# Values (counted as commas and opening brackets) in the JSON, checked before it is parsed:
# each costs an object (`[],` x 9 million, 27 MB, took orjson 2.7 s and 650 MB). A request
# needs a few dozen; the cap is above any real one at the default limits (64 elements of
# 2,000 characters of text, every character a comma) and bounds a parse to ~15 ms and ~8 MB.
MAX_JSON_VALUES = 1 << 17


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None  # None: the request's `binary_data_output` decides


@dataclass(frozen=True)
class InferRequest:
    request_id: str | None
    input_name: str
    elements: tuple[bytes | str, ...]  # str: a JSON string sent as text; bytes otherwise
    outputs: tuple[RequestedOutput, ...]  # empty: every output
    binary_output: bool

    def wants_binary(self, output: RequestedOutput) -> bool:
        return self.binary_output if output.binary is None else output.binary


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str  # "BYTES" or "FP32"
    shape: tuple[int, ...]
    data: list[str] | list[float]


def _refuse(message: str) -> RequestRefused:
    return RequestRefused(400, message)


# ---- requests ---------------------------------------------------------------


def parse_infer_request(
    body: bytes,
    header_length: str | None,
    *,
    input_name: str,
    max_elements: int,
    values_bounded: bool = False,
) -> InferRequest:
    """Decode an inference request body (JSON, or JSON + binary tensor data). `values_bounded`:
    the caller has counted the JSON's separators (`json_separators`) and found at most
    MAX_JSON_VALUES, so they are not counted again."""
    json_end = _json_end(body, header_length)
    header = _load_json(body[:json_end], values_bounded=values_bounded)
    tensor = _single_input(header, input_name)
    count = _element_count(tensor, input_name, max_elements)
    params = _params(tensor, f"input {input_name!r}")
    content_type = params.get("content_type")
    if content_type not in _CONTENT_TYPES:
        raise _refuse(f"content_type {quote(content_type)} is not supported; use 'str' or 'base64'.")
    binary_size = params.get("binary_data_size")
    if binary_size is None:
        if json_end != len(body):
            raise _refuse(f"{len(body) - json_end} bytes follow the JSON header, but no input has "
                          "binary_data_size.")  # fmt: skip
        elements: list[bytes | str] = list(_json_elements(tensor, input_name, count))
    else:
        if "data" in tensor:
            raise _refuse(f"input {input_name!r} has both data and binary_data_size; send one.")
        raw = _binary_section(body, json_end, binary_size, input_name)
        elements = list(_split_bytes(raw, count))
    if content_type == "base64":
        elements = [_b64(element, i) for i, element in enumerate(elements)]
    return InferRequest(
        request_id=_request_id(header),
        input_name=input_name,
        elements=tuple(elements),
        outputs=_requested_outputs(header),
        binary_output=_flag(_params(header, "the request").get("binary_data_output"), "binary_data_output"),
    )


def _json_end(body: bytes, header_length: str | None) -> int:
    if header_length is None:
        return len(body)
    length = byte_count(header_length)
    if length is None or not 0 < length <= len(body):
        raise _refuse(f"Inference-Header-Content-Length must be a byte count between 1 and the body's "
                      f"{len(body)}; got {quote(header_length)}.")  # fmt: skip
    return length


_COMMA, _OPENING = ord(","), ord("{")  # "[" is "{" without bit 5 (0x5B, 0x7B)


def json_separators(data: bytes) -> int:
    """Commas and opening brackets in `data`: a bound on the values a JSON document holds.
    Two vectorised compares: about 65 us for a 320 KB body holding a photo in base64, where
    `bytes.translate` deleting the other bytes took about 110 us and three `bytes.count` 270."""
    array = np.frombuffer(data, dtype=np.uint8)
    return int(np.count_nonzero(array == _COMMA)) + int(np.count_nonzero((array | 0x20) == _OPENING))


def _load_json(data: bytes, *, values_bounded: bool = False) -> dict[str, Any]:
    # A body this short cannot hold more values than the cap (each takes 2 bytes or more):
    # the count is paid only by large bodies, never by a hit's small one.
    if len(data) > 2 * MAX_JSON_VALUES and not values_bounded:
        values = json_separators(data)
        if values > MAX_JSON_VALUES:
            raise _refuse(f"The request's JSON holds too many values (over {MAX_JSON_VALUES:,}); a request "
                          "needs a few. Send large data as one string, or as binary data.")  # fmt: skip
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError:
        # orjson is stricter (huge integers, NaN, lone surrogates): the standard parser
        # decides what is accepted and words the refusal.
        header = _load_json_slowly(data)
    if not isinstance(header, dict):
        raise _refuse("The request body must be a JSON object with an 'inputs' list.")
    return header


def _load_json_slowly(data: bytes) -> Any:
    try:
        return json.loads(data, parse_int=_bounded_int)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 or nested too deeply"
        raise _refuse(f"The request body is not valid JSON: {detail}.") from None


def _bounded_int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS + 1:  # +1: a sign
        raise _refuse(f"The request holds an integer of {len(digits):,} digits; at most {MAX_INT_DIGITS} are "
                      "accepted.")  # fmt: skip
    return int(digits)


def _single_input(header: dict[str, Any], input_name: str) -> dict[str, Any]:
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _refuse("The request has no 'inputs' list.")
    if len(inputs) != 1:
        raise _refuse(f"This model takes one input ({input_name!r}); the request has {len(inputs)}.")
    tensor = inputs[0]
    if not isinstance(tensor, dict):
        raise _refuse("Each input must be a JSON object.")
    if tensor.get("name") != input_name:
        name = tensor.get("name")
        raise _refuse(f"Unknown input {quote(name)}; this model takes one input named {input_name!r}.")
    if tensor.get("datatype") != "BYTES":
        raise _refuse(f"Input {input_name!r} must have datatype BYTES, not {quote(tensor.get('datatype'))}.")
    return tensor


def _element_count(tensor: dict[str, Any], input_name: str, max_elements: int) -> int:
    """The shape's element count, bounded before it is computed: at most MAX_DIMS dimensions,
    each at most `max_elements` (a shape of 60,000 dimensions of 2**62 would otherwise be a
    product of a million digits, held under the GIL for seconds), the product checked as it
    grows. Only a shape found small is quoted."""
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not shape:
        raise _refuse(f"Input {input_name!r} needs a shape: a list of non-negative integers, e.g. [1].")
    if len(shape) > MAX_DIMS:
        raise _refuse(f"Input {input_name!r} has a shape of {len(shape):,} dimensions; at most {MAX_DIMS}.")
    if not all(_is_count(d) for d in shape):
        raise _refuse(f"Input {input_name!r} needs a shape: a list of non-negative integers, e.g. [1].")
    if 0 in shape:
        raise _refuse(f"Input {input_name!r} has no elements (a dimension of its shape is 0).")
    count = 1
    for dim in shape:
        count *= dim if dim <= max_elements else max_elements + 1  # never a product past the cap
        if count > max_elements:
            raise _refuse(f"At most {max_elements} elements per request; the shape of input "
                          f"{input_name!r} holds more.")  # fmt: skip
    return count


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise _refuse(f"The parameters of {where} must be a JSON object.")
    return params


def _flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse(f"{name} must be true or false, not {quote(value)}.")
    return value


def _json_elements(tensor: dict[str, Any], input_name: str, count: int) -> list[str]:
    if "data" not in tensor:
        raise _refuse(f"Input {input_name!r} has no data: send 'data', or 'binary_data_size' with the "
                      "bytes after the JSON header.")  # fmt: skip
    # OIP allows nested (row-major) lists as well as a flat one; walked without recursion.
    flat: list[str] = []
    stack = [tensor["data"]]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            flat.append(item)
        else:
            raise _refuse(f"BYTES data must be strings; element {len(flat)} is {type(item).__name__}.")
        if len(flat) > count:
            break
    if len(flat) != count:
        shape = tensor["shape"]
        raise _refuse(f"Shape {shape} holds {count} elements but the data holds "
                      f"{'more' if len(flat) > count else len(flat)}.")  # fmt: skip
    return flat


def _binary_section(body: bytes, start: int, size: Any, input_name: str) -> bytes:
    if not _is_count(size):
        raise _refuse(f"binary_data_size of input {input_name!r} must be a non-negative integer.")
    available = len(body) - start
    if available < size:
        raise _refuse(f"Input {input_name!r} declares binary_data_size {quote(size)}, but only {available} "
                      "bytes follow the JSON header (is Inference-Header-Content-Length set?).")  # fmt: skip
    if available > size:
        raise _refuse(f"{available - size} unexpected bytes follow input {input_name!r}'s binary data.")
    return body[start:]


def _split_bytes(raw: bytes, count: int) -> list[bytes]:
    """BYTES elements from their binary form: 4-byte little-endian length, then the bytes.
    Stops at the first element past `count` (26 MB of empty elements are 6.7 million)."""
    elements: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(raw) - offset < _LENGTH.size:
            raise _refuse(f"Binary BYTES data is malformed: {len(raw) - offset} stray bytes at the end.")
        if len(elements) == count:
            raise _refuse(f"The shape holds {count} elements but the binary data holds more.")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if length > len(raw) - offset:
            raise _refuse(f"Binary BYTES data is malformed: element {len(elements)} declares {length} bytes "
                          f"but {len(raw) - offset} remain.")  # fmt: skip
        elements.append(raw[offset : offset + length])
        offset += length
    if len(elements) != count:
        raise _refuse(f"The shape holds {count} elements but the binary data holds {len(elements)}.")
    return elements


def _b64(element: bytes | str, index: int) -> bytes:
    # pybase64 (SIMD): 0.01 ms for a 140 KB image, against the standard library's 1.5 ms of a
    # 2.6 ms cached answer over JSON. It refuses some sloppy padding (`iaA8=`) that
    # base64.b64decode(validate=True) accepts, and never accepts what that refuses: a string it
    # refuses is read by the standard library, so the strings accepted stay what they were.
    try:
        return pybase64.b64decode(element, validate=True)
    except ValueError:  # binascii.Error is one
        pass
    try:
        return base64.b64decode(element, validate=True)
    except ValueError:  # binascii.Error, or a str with non-ASCII characters
        raise _refuse(f"Element {index} is not valid base64 (content_type 'base64').") from None


def _request_id(header: dict[str, Any]) -> str | None:
    request_id = header.get("id")
    if request_id is None:
        return None
    if not isinstance(request_id, str):
        raise _refuse("The request 'id' must be a string.")
    try:
        request_id.encode()  # echoed in the response as UTF-8, which a lone surrogate is not
    except UnicodeEncodeError:
        raise _refuse("The request 'id' is not valid Unicode text.") from None
    return request_id


def _requested_outputs(header: dict[str, Any]) -> tuple[RequestedOutput, ...]:
    outputs = header.get("outputs", [])
    if not isinstance(outputs, list):
        raise _refuse("'outputs' must be a list.")
    requested = []
    for output in outputs:
        name = output.get("name") if isinstance(output, dict) else None
        if name not in OUTPUT_NAMES:
            raise _refuse(f"Unknown output {quote(name)}; this model gives 'label' and 'score'.")
        if any(r.name == name for r in requested):
            raise _refuse(f"Output {name!r} is requested twice.")
        params = _params(output, f"output {name!r}")
        if "classification" in params:
            raise _refuse("The classification extension is not supported: 'label' and 'score' already "
                          "hold the top classes.")  # fmt: skip
        if "shared_memory_region" in params:
            raise _refuse("Shared-memory outputs are not supported over this API.")
        binary = params.get("binary_data")
        requested.append(RequestedOutput(name, None if binary is None else _flag(binary, "binary_data")))
    return tuple(requested)


# ---- responses --------------------------------------------------------------


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON (orjson; the standard encoder for what orjson refuses, e.g. an
    integer over 64 bits, so that the outcome is the standard encoder's)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class EncodedOutputs:
    """A response's outputs, encoded once: what `encode_infer_response` appends to any header.
    The same outputs of the same answer give the same bytes, so a caller may keep them."""

    described: tuple[dict[str, Any], ...]  # the "outputs" list of the JSON header (never mutated)
    described_json: bytes  # orjson's encoding of that list
    binary: bytes | None  # the binary outputs' data, in order; None: every output is JSON


def encode_outputs(outputs: list[tuple[OutputTensor, bool]]) -> EncodedOutputs:
    described = []
    binary_parts = []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype}
        entry["shape"] = list(tensor.shape)
        if binary:
            raw = _tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            binary_parts.append(raw)
        else:
            entry["data"] = _json_values(tensor)
        described.append(entry)
    binary_data = b"".join(binary_parts) if binary_parts else None
    return EncodedOutputs(tuple(described), orjson.dumps(described), binary_data)


def encode_infer_response(
    header: dict[str, Any], outputs: list[tuple[OutputTensor, bool]] | EncodedOutputs
) -> tuple[bytes, int | None]:
    """(body, JSON header length). The length is None when every output is JSON, in which
    case the body is plain JSON; otherwise the binary outputs follow the header in order."""
    encoded_outputs = outputs if isinstance(outputs, EncodedOutputs) else encode_outputs(outputs)
    try:
        # The header's JSON and the outputs' joined: the bytes orjson gives for the whole object.
        head = orjson.dumps(header)
        comma = b"," if header else b""
        encoded = b'%b%b"outputs":%b}' % (head[:-1], comma, encoded_outputs.described_json)
    except TypeError:  # something orjson refuses: the whole object through `dumps`, as it always was
        encoded = dumps({**header, "outputs": list(encoded_outputs.described)})
    if encoded_outputs.binary is None:
        return encoded, None
    return encoded + encoded_outputs.binary, len(encoded)


def _tensor_bytes(tensor: OutputTensor) -> bytes:
    if tensor.datatype == "BYTES":
        parts = []
        for value in tensor.data:
            data = str(value).encode()
            parts += [_LENGTH.pack(len(data)), data]
        return b"".join(parts)
    return np.asarray(tensor.data, dtype="<f4").tobytes()


def _json_values(tensor: OutputTensor) -> list[Any]:
    if tensor.datatype == "FP32":
        # The float32 values themselves, so a JSON answer equals the binary one exactly.
        return np.asarray(tensor.data, dtype=np.float32).tolist()
    return list(tensor.data)
