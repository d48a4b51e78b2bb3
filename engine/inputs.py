"""Validation and canonicalisation of raw inputs.

The canonical form is what cache keys hash, so two inputs that the model must
see identically have identical canonical forms:

- image: decoded pixels after EXIF orientation, as C-contiguous uint8 RGB with
  their shape; PNG, BMP and lossless WebP of one picture give the same bytes.
- text: Unicode NFKC, control and bidi-override characters removed, whitespace
  collapsed, stripped.
"""

from __future__ import annotations

import io
import re
import unicodedata
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.errors import InvalidInputError

ALLOWED_IMAGE_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "BMP", "DIB", "GIF", "TIFF"})

# Bidi embedding/override/isolate controls: they reorder what a reader sees
# without changing meaning for the model, and are a common spoofing trick.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")
# Joiners shape some scripts (Persian, Indic) and emoji sequences: keep them.
_KEPT_FORMAT_CHARS = frozenset("\u200c\u200d")
_WHITESPACE = re.compile(r"\s+")
_PILLOW_PIXELS = re.compile(r"Image size \((\d+) pixels\)")


@dataclass(frozen=True, eq=False)
class CanonicalImage:
    """Decoded RGB pixels, shape (height, width, 3), dtype uint8, C-contiguous."""

    pixels: np.ndarray

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.pixels.shape)  # type: ignore[return-value]

    def fingerprint_parts(self) -> tuple[bytes, memoryview]:
        """What a digest hashes: the shape header, then the raw pixel buffer (no copy)."""
        h, w, c = self.shape
        return f"rgb8:{h}x{w}x{c}:".encode(), memoryview(self.pixels).cast("B")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CanonicalImage) and np.array_equal(self.pixels, other.pixels)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class CanonicalText:
    text: str

    def fingerprint_parts(self) -> tuple[bytes, bytes]:
        return b"text:", self.text.encode("utf-8")


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P":
        # Palette images may carry transparency; resolve it before flattening.
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit (or 32-bit integer) greyscale: scale to 8 bits instead of clipping.
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if values.max(initial=0) > 255 or mode.startswith("I;16") else 255.0
        grey = np.clip(np.rint(values * (255.0 / top)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode == "F":
        values = np.asarray(image, dtype=np.float64)
        grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "A" in mode:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def canonicalize_image(data: bytes, *, max_bytes: int, max_pixels: int) -> CanonicalImage:
    """Decode an uploaded file into canonical pixels, or raise InvalidInputError.

    Size and pixel limits are checked from the header, before any pixel is
    allocated, so a decompression bomb costs nothing.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInputError("not_an_image", "Please upload an image file.")
    size = len(data)
    if size == 0:
        raise InvalidInputError("empty_file", "The uploaded file is empty (0 bytes).")
    if size > max_bytes:
        raise InvalidInputError(
            "file_too_large",
            f"The file is {size / 1e6:.1f} MB; the limit is {max_bytes / 1e6:.1f} MB.",
        )
    try:
        with warnings.catch_warnings():
            # Our own limit below is checked on the header; Pillow's warning adds nothing.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(bytes(data)))
    except Image.DecompressionBombError as exc:
        # Beyond twice Pillow's own limit the header's size is only in the message.
        found = _PILLOW_PIXELS.search(str(exc))
        raise _too_many_pixels(None, max_pixels, int(found.group(1)) if found else None) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise InvalidInputError(
            "not_an_image",
            "This file is not an image we can read. Use PNG, JPEG, WebP, BMP, GIF or TIFF.",
        ) from None

    with image:
        if image.format not in ALLOWED_IMAGE_FORMATS:
            raise InvalidInputError(
                "unsupported_format",
                f"{image.format} images are not supported. Use PNG, JPEG, WebP, BMP, GIF or TIFF.",
            )
        width, height = image.size
        if width <= 0 or height <= 0:
            raise InvalidInputError("not_an_image", "The image has no pixels.")
        if width * height > max_pixels:
            raise _too_many_pixels((width, height), max_pixels)
        try:
            # First frame only for animations; refuse truncated data rather than guess.
            if getattr(image, "n_frames", 1) > 1:
                image.seek(0)
            image.load()
            upright = ImageOps.exif_transpose(image) or image
            rgb = _to_rgb(upright)
            pixels = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
        except (OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError):
            raise InvalidInputError(
                "corrupt_image",
                "The image file is truncated or corrupted. Please upload it again.",
            ) from None
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise InvalidInputError("corrupt_image", "The image could not be converted to RGB.")
    pixels.setflags(write=False)
    return CanonicalImage(pixels)


def _too_many_pixels(
    size: tuple[int, int] | None, max_pixels: int, pixel_count: int | None = None
) -> InvalidInputError:
    if size is not None:
        found = f"The image is {size[0]:,} x {size[1]:,} pixels"
    elif pixel_count is not None:
        found = f"The image has {pixel_count:,} pixels"
    else:
        found = "The image has too many pixels"
    return InvalidInputError(
        "image_too_large",
        f"{found}; the limit is {max_pixels / 1e6:.0f} megapixels. Please upload a smaller image.",
    )


def clean_text(raw: object, *, max_chars: int) -> CanonicalText:
    """NFKC, drop control/bidi characters, collapse whitespace; refuse empty or long."""
    if not isinstance(raw, str):
        raise InvalidInputError("not_text", "Please type a message.")
    # Refuse grossly oversized input before spending time normalising it.
    if len(raw) > max_chars * 8:
        raise _too_long(len(raw), max_chars)
    text = unicodedata.normalize("NFKC", raw)
    text = _WHITESPACE.sub(" ", text)
    kept = []
    for char in text:
        category = unicodedata.category(char)
        if char in _BIDI_CONTROLS or category in ("Cc", "Cs", "Co"):
            continue
        if category == "Cf" and char not in _KEPT_FORMAT_CHARS:
            continue
        kept.append(char)
    text = _WHITESPACE.sub(" ", "".join(kept)).strip()
    if not text:
        raise InvalidInputError("empty_text", "The message is empty. Please type a question.")
    if len(text) > max_chars:
        raise _too_long(len(text), max_chars)
    return CanonicalText(text)


def _too_long(length: int, max_chars: int) -> InvalidInputError:
    return InvalidInputError(
        "text_too_long",
        f"The message is {length:,} characters long; the limit is {max_chars:,}. Please shorten it.",
    )
