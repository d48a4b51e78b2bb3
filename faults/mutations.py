"""Hostile inputs: mutated image files, hostile texts, and damaged or foreign stored values."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import struct
import sys
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
from PIL import Image

from bench.models import load_photos
from engine.cache.codec import ALIAS_SCHEMA, RESULT_SCHEMA


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """libtiff prints warnings for broken TIFFs straight to fd 2; keep them out of the report."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def base_images(seed: int, photos: int = 4) -> list[tuple[str, bytes]]:
    """Small valid files in every accepted format and in awkward modes."""
    rng = random.Random(seed)
    photos = load_photos(("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png")[:photos])
    out: list[tuple[str, bytes]] = []
    for index, data in enumerate(photos.values()):
        photo = Image.open(io.BytesIO(data)).convert("RGB")
        crop = photo.resize((96 + 8 * index, 80 + 8 * index))

        def save(image: Image.Image, fmt: str, **params: Any) -> bytes:
            buffer = io.BytesIO()
            image.save(buffer, fmt, **params)
            return buffer.getvalue()

        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: rotate 90
        rgba = crop.convert("RGBA")
        rgba.putalpha(Image.new("L", crop.size, rng.randint(40, 255)))
        palette = crop.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        palette.info["transparency"] = 0
        grey16 = crop.convert("I").point(lambda v: v * 256)
        frames = [crop, crop.rotate(90)]
        gif = io.BytesIO()
        frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
        out += [
            ("png", save(crop, "PNG")),
            ("png-rgba", save(rgba, "PNG")),
            ("png-palette", save(palette, "PNG", transparency=0)),
            ("png-16bit", save(grey16.convert("I;16"), "PNG")),
            ("jpeg", save(crop, "JPEG", quality=85)),
            ("jpeg-progressive", save(crop, "JPEG", quality=80, progressive=True)),
            ("jpeg-cmyk", save(crop.convert("CMYK"), "JPEG")),
            ("jpeg-exif-rotated", save(crop, "JPEG", exif=exif)),
            ("bmp", save(crop, "BMP")),
            ("gif-animated", gif.getvalue()),
            ("webp-lossless", save(crop, "WEBP", lossless=True)),
            ("webp", save(crop, "WEBP", quality=70)),
            ("tiff", save(crop, "TIFF")),
            ("tiff-lzw", save(crop, "TIFF", compression="tiff_lzw")),
        ]
    return out


MAGICS = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff\xe0",
    b"GIF89a",
    b"BM",
    b"RIFF\x00\x00\x00\x00WEBP",
    b"II*\x00",
    b"MM\x00*",
    b"%PDF-1.4",
    b"PK\x03\x04",
    b"\x7fELF",
    b"<svg xmlns='http://www.w3.org/2000/svg'>",
    b"<html>",
    b"\x00\x00\x01\x00",
    b"8BPS",
    b"\x00\x00\x00\x0cjP  ",
    b"#!/bin/sh\n",
)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_size(width: int, height: int, *, fix_crc: bool = True, body: bytes | None = None) -> bytes:
    """A PNG header declaring any size, with a tiny (or given) body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = _png_chunk(b"IHDR", ihdr)
    if not fix_crc:
        chunk = chunk[:-4] + b"\0\0\0\0"
    idat = body if body is not None else zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def png_bomb(side: int) -> bytes:
    """A real 1-bit PNG of `side` x `side` zeros: a few kB on disk, side^2 pixels decoded."""
    row = b"\0" + b"\0" * ((side + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


# Declared sizes: every one is either over the pixel limit (refused from the header) or empty.
# (Thin images under the limit are a separate, measured case: see `thin_image_cost`.)
HUGE_SIZES = (
    (65_535, 65_535), (100_000, 100_000), (2**31 - 1, 2**31 - 1), (50_000, 50_000), (65_535, 10_000),
    (10_000, 65_535), (2**31 - 1, 1), (1, 2**31 - 1), (0, 0), (0, 500), (500, 0),
)  # fmt: skip


def _declare_huge(fmt: str, data: bytes, rng: random.Random) -> bytes | None:
    """Patch the declared dimensions of a valid file; None when the format has no simple field."""
    width, height = rng.choice(HUGE_SIZES)
    w16, h16 = min(width, 65_535), min(height, 65_535)
    if 0 < w16 * h16 <= 40_000_000:  # 16-bit fields cannot say 2**31: keep it over the limit
        w16 = h16 = 65_535
    out = bytearray(data)
    if fmt.startswith("png"):  # a new IHDR (8-bit RGB of the declared size), the original chunks after it
        return png_with_size(width, height, fix_crc=rng.random() < 0.8)[:33] + data[33:]
    if fmt.startswith("gif"):
        out[6:10] = struct.pack("<HH", w16, h16)
        return bytes(out)
    if fmt == "bmp":
        out[18:26] = struct.pack(
            "<ii", min(width, 2**31 - 1), -min(height, 2**31 - 1) if rng.random() < 0.3 else height
        )
        return bytes(out)
    if fmt.startswith("jpeg"):
        for marker in (b"\xff\xc0", b"\xff\xc2"):
            at = data.find(marker)
            if at > 0:
                out[at + 5 : at + 9] = struct.pack(">HH", h16, w16)
                return bytes(out)
    return None


def declared_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from the header alone, or None when Pillow cannot even open it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                return image.size
    except Exception:  # anything Pillow raises on garbage
        return None


def thin(data: bytes, max_pixels: int = 40_000_000, max_ratio: float = 20.0) -> bool:
    """Accepted by the pixel limit but far from square: costs far more than its pixels (see
    `thin_image_cost`), so random mutations that happen to produce one are left out."""
    size = declared_size(data)
    if size is None or min(size) <= 0 or size[0] * size[1] > max_pixels:
        return False
    return max(size) / min(size) > max_ratio


def mutate(fmt: str, data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of a valid file: truncation, flipped bytes, a wrong header or a huge size."""
    kind = rng.choice(
        (
            "truncate",
            "truncate",
            "flip",
            "flip",
            "flip-header",
            "magic",
            "magic",
            "huge",
            "huge",
            "junk",
            "splice",
            "zero",
        )
    )
    out = bytearray(data)
    if kind == "truncate":
        cut = rng.choice(
            (
                1,
                2,
                7,
                8,
                16,
                33,
                64,
                len(data) // 4,
                len(data) // 2,
                len(data) - 1,
                rng.randrange(1, len(data)),
            )
        )
        return kind, bytes(out[: max(1, min(cut, len(data) - 1))])
    if kind in ("flip", "flip-header"):
        span = min(len(data), 96) if kind == "flip-header" else len(data)
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            out[rng.randrange(span)] ^= rng.randrange(1, 256)
        return kind, bytes(out)
    if kind == "magic":
        magic = rng.choice(MAGICS)
        return kind, (magic + bytes(out[len(magic) :])) if rng.random() < 0.7 else magic + bytes(out)
    if kind == "huge":
        patched = _declare_huge(fmt, data, rng)
        if patched is not None:
            return kind, patched
        kind = "junk"
    if kind == "junk":
        junk = rng.randbytes(rng.choice((1, 16, 4096)))
        return kind, (junk + data) if rng.random() < 0.5 else (data + junk)
    if kind == "splice":
        at = rng.randrange(1, len(data))
        return kind, data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
    return kind, bytes(len(data)) if rng.random() < 0.5 else rng.randbytes(len(data))


HOSTILE_TEXTS = Path(__file__).with_name("hostile_texts.json")


def fixed_hostile_texts() -> list[tuple[str, Any]]:
    """The fixed list (`hostile_texts.json`): each entry a `text` repeated `times` times, the
    concatenation of `parts` ([text, times] pairs: this keeps lone surrogates apart, which JSON
    would join into a pair), or a non-string JSON `value`."""
    out: list[tuple[str, Any]] = []
    for entry in json.loads(HOSTILE_TEXTS.read_text(encoding="ascii")):
        if "value" in entry:
            out.append((entry["name"], entry["value"]))
        else:
            parts = entry.get("parts") or [[entry["text"], entry.get("times", 1)]]
            out.append((entry["name"], "".join(text * times for text, times in parts)))
    return out


def hostile_texts(count: int, seed: int) -> list[tuple[str, Any]]:
    """Fixed nasty messages (empty, 1 MB, controls, lone surrogates, bidi overrides...) and random ones."""
    rng = random.Random(seed)
    fixed = fixed_hostile_texts()
    alphabet = (
        [chr(c) for c in range(32, 127)] * 3
        + [chr(c) for c in range(0, 32)]
        + ["\x7f", "\x85", "\x9f"]
        + [chr(c) for c in (0xD800, 0xDBFF, 0xDC00, 0xDFFF)]
        + list("\u202a\u202b\u202c\u202d\u202e\u2066\u2069")
        + list("\u200b\u200c\u200d\u200e\u200f\ufeff")
        + [chr(c) for c in range(0x300, 0x310)]
        + list("\u00e9\u00df\u0130\ufb01\ufdfa\u2126\u212b\uff21")
        + ["\U0001f600", "\U0001f468\u200d"]
        + ["\u4e2d", "\u05d0", "\u0627", " ", " ", "\n", "\t"]
    )
    out = list(fixed)
    while len(out) < count:
        length = rng.choice((0, 1, 3, 10, 40, 200, 1000, 1999, 2001, 5000, 16_500))
        out.append((f"random-{len(out)}", "".join(rng.choice(alphabet) for _ in range(length))))
    return out


class _Tripwire:
    """Unpickling this creates a file: proof that a value went through pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def unpack_value(valid: bytes) -> tuple[dict[str, Any], bytes]:
    """A stored value's msgpack map, and whatever follows it (a checksum, in the current format)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(valid)
    doc = next(unpacker)
    return doc, valid[unpacker.tell() :]


def _flip(value: bytes, at: int, mask: int) -> bytes:
    return value[:at] + bytes([value[at] ^ mask]) + value[at + 1 :]


def bit_rot(valid: bytes, kind: str) -> list[tuple[str, bytes]]:
    """One flipped bit that leaves the msgpack well-formed: what a bad disk, a bad DIMM or a
    buggy proxy does to the stored bytes. Only a checksum can tell these from the real thing."""
    doc, _ = unpack_value(valid)
    out = []
    if kind == "result":
        label, score = doc["p"][0]
        at = valid.find(label.encode())
        if at >= 0:  # one bit of the top label's first letter (ASCII stays ASCII)
            out.append(("one bit of the top label", _flip(valid, at, 0x01)))
        packed = b"\xcb" + struct.pack(">d", score)
        at = valid.find(packed)
        if at >= 0:  # the last bit of the top score's mantissa
            out.append(("one bit of the top score", _flip(valid, at + len(packed) - 1, 0x01)))
    else:
        digest = doc["d"]
        digit = next((i for i, c in enumerate(digest) if c.isdigit()), None)
        at = valid.find(digest.encode())
        if digit is not None and at >= 0:  # a digit of the digest becomes another digit
            out.append(("one bit of the alias digest", _flip(valid, at + digit, 0x01)))
    return out


def corruptions(
    valid: bytes, kind: str, rng: random.Random, tripwire: Path, neighbour: bytes | None
) -> list[tuple[str, bytes]]:
    """Values a cache key must never serve: damaged copies of its value, the value of another
    live key of the same kind (`neighbour`), and values in foreign formats."""
    flipped = bytearray(valid)
    flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
    doc, tail = unpack_value(valid)
    foreign = dict(doc, s=doc["s"].rsplit("/", 1)[0] + "/2")
    other_kind = (
        {"s": ALIAS_SCHEMA, "d": "0" * 32}
        if kind == "result"
        else {"s": RESULT_SCHEMA, "p": [["tabby", 0.9]], "v": "x", "t": 1.0}
    )
    wrong_types = {**doc, "t": "yesterday"} if kind == "result" else {**doc, "d": "../../etc"}

    def framed(document: Any) -> bytes:  # in the store's framing, with the original trailer
        return msgpack.packb(document, use_bin_type=True) + tail

    moved = [("another live key's value", neighbour)] if neighbour is not None and neighbour != valid else []
    return [
        *bit_rot(valid, kind),
        *moved,
        ("random byte flipped", bytes(flipped)),
        ("truncated", valid[: rng.randrange(1, len(valid))]),
        ("random bytes", rng.randbytes(rng.randint(1, 200))),
        ("empty", b""),
        ("pickle", pickle.dumps(_Tripwire(str(tripwire)))),
        ("json", json.dumps(doc).encode()),
        ("next schema version", framed(foreign)),
        ("other kind of entry", framed(other_kind)),
        ("a list", framed([doc.get("s"), 1, 2])),
        ("fields of the wrong type", framed(wrong_types)),
    ]
