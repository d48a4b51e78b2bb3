"""Unit tests of `engine.inputs`: canonical forms, accepted image modes and refused inputs.

No model is loaded here: `canonicalize_image` and `clean_text` are called directly.
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import time
import tracemalloc
import unicodedata
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.cache.keys import digest_parts
from engine.errors import InvalidInputError
from engine.inputs import CanonicalImage, CanonicalText, canonicalize_image, clean_text
from settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = Settings.from_env({})
MAX_BYTES = DEFAULTS.limits.max_upload_bytes
MAX_PIXELS = DEFAULTS.limits.max_image_pixels
MAX_CHARS = DEFAULTS.limits.max_text_chars

PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png")
LOSSLESS_FORMATS = {
    "PNG": {},
    "BMP": {},
    "WEBP": {"lossless": True, "quality": 100, "exact": True},
}
# EXIF Orientation -> the transpose that, applied to the upright picture, gives the stored
# pixels; a viewer (and exif_transpose) applies the inverse to show it upright again.
ORIENTATION_STORED = {
    3: Image.Transpose.ROTATE_180,
    6: Image.Transpose.ROTATE_90,
    8: Image.Transpose.ROTATE_270,
}
EXIF_ORIENTATION_TAG = 0x0112
TRACEBACK_MARKERS = ("Traceback", 'File "', "Error", "Exception", "PIL.", "\n")


# --------------------------------------------------------------------------- helpers


def canonical(data: bytes, *, max_bytes: int = MAX_BYTES, max_pixels: int = MAX_PIXELS) -> CanonicalImage:
    return canonicalize_image(data, max_bytes=max_bytes, max_pixels=max_pixels)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def fingerprint(image: CanonicalImage) -> str:
    return digest_parts(image.fingerprint_parts())


def assert_rgb8(image: CanonicalImage, size: tuple[int, int]) -> None:
    width, height = size
    assert isinstance(image, CanonicalImage)
    assert image.pixels.dtype == np.uint8
    assert image.pixels.shape == (height, width, 3), image.pixels.shape
    assert image.pixels.flags.c_contiguous
    assert not image.pixels.flags.writeable, "canonical pixels must be read-only (they are hashed)"


def assert_user_facing(error: InvalidInputError) -> None:
    assert error.code and error.code.islower() and " " not in error.code, error.code
    assert isinstance(error.message, str) and error.message.strip(), "message must not be empty"
    assert str(error) == error.message
    for marker in TRACEBACK_MARKERS:
        assert marker not in error.message, f"message {error.message!r} leaks internals ({marker!r})"


def png_header_only(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG whose IHDR claims width x height 8-bit RGB pixels.

    The IDAT holds a few bytes only: a decoder that trusts the header and allocates
    the pixels first would need width * height * 3 bytes.
    """

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=PHOTOS)
def photo(request: pytest.FixtureRequest, photo_bytes: Callable[[str], bytes]) -> Image.Image:
    """A scikit-image sample photo, decoded once as an RGB Pillow image."""
    with Image.open(io.BytesIO(photo_bytes(request.param))) as image:
        return image.convert("RGB")


@pytest.fixture(scope="module")
def chelsea(photo_bytes: Callable[[str], bytes]) -> Image.Image:
    with Image.open(io.BytesIO(photo_bytes("chelsea.png"))) as image:
        return image.convert("RGB")


@pytest.fixture(scope="module")
def small_photo(chelsea: Image.Image) -> Image.Image:
    """A small non-square crop, so rotations change the shape."""
    return chelsea.crop((100, 50, 164, 98))


# --------------------------------------------------------------------------- canonical pixels


def test_lossless_formats_give_identical_pixels_and_digest(photo: Image.Image) -> None:
    expected = np.asarray(photo)
    results = {fmt: canonical(encode(photo, fmt, **params)) for fmt, params in LOSSLESS_FORMATS.items()}
    for fmt, result in results.items():
        assert_rgb8(result, photo.size)
        assert np.array_equal(result.pixels, expected), f"{fmt} pixels differ from the decoded photo"
        assert result.pixels.tobytes() == expected.tobytes()
    digests = {fmt: fingerprint(result) for fmt, result in results.items()}
    assert len(set(digests.values())) == 1, f"lossless encodings must share one digest: {digests}"
    assert results["PNG"] == results["BMP"] == results["WEBP"]


def test_digest_depends_on_shape_not_only_on_bytes() -> None:
    flat = np.zeros((4, 6, 3), dtype=np.uint8)
    wide = canonical(encode(Image.fromarray(flat), "PNG"))
    tall = canonical(encode(Image.fromarray(flat.reshape(6, 4, 3)), "PNG"))
    assert wide.pixels.tobytes() == tall.pixels.tobytes()
    assert fingerprint(wide) != fingerprint(tall), "same buffer, other shape: a different input"


@pytest.mark.parametrize("orientation", sorted(ORIENTATION_STORED))
@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_exif_rotated_copy_gives_the_upright_pixels(
    small_photo: Image.Image, orientation: int, fmt: str
) -> None:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = orientation
    stored = small_photo.transpose(ORIENTATION_STORED[orientation])
    params = dict(LOSSLESS_FORMATS.get(fmt, {}))
    rotated = canonical(encode(stored, fmt, exif=exif.tobytes(), **params))
    upright = canonical(encode(small_photo, "PNG"))
    assert_rgb8(rotated, small_photo.size)
    assert np.array_equal(rotated.pixels, upright.pixels), (
        f"{fmt} with EXIF Orientation={orientation} was not turned upright"
    )
    assert fingerprint(rotated) == fingerprint(upright)


def test_exif_rotation_changes_nothing_without_the_tag(small_photo: Image.Image) -> None:
    stored = small_photo.transpose(Image.Transpose.ROTATE_90)
    result = canonical(encode(stored, "PNG"))
    assert np.array_equal(result.pixels, np.asarray(stored))


def test_jpeg_reencode_is_a_different_input(photo: Image.Image) -> None:
    """A lossy JPEG re-encode changes pixels: it is a different input, with a different key.

    This is expected behaviour, not a bug: the canonical form is the decoded pixels.
    """
    lossless = canonical(encode(photo, "PNG"))
    lossy = canonical(encode(photo, "JPEG", quality=95))
    assert lossy.shape == lossless.shape
    assert not np.array_equal(lossy.pixels, lossless.pixels), (
        "expected different pixels: a lossy JPEG re-encode is a different input"
    )
    assert fingerprint(lossy) != fingerprint(lossless), (
        "expected a different digest: a lossy JPEG re-encode is a different input"
    )


def test_same_jpeg_bytes_are_the_same_input(photo_bytes: Callable[[str], bytes]) -> None:
    data = photo_bytes("rocket.jpg")
    first, second = canonical(data), canonical(bytes(data))
    assert first == second
    assert fingerprint(first) == fingerprint(second)


def test_bytearray_and_memoryview_are_accepted(small_photo: Image.Image) -> None:
    data = encode(small_photo, "PNG")
    expected = canonical(data)
    assert canonical(bytearray(data)) == expected
    assert canonical(memoryview(data)) == expected


# --------------------------------------------------------------------------- image modes


def _palette_with_transparency() -> tuple[bytes, tuple[int, int]]:
    image = Image.new("P", (4, 2), 0)
    image.putpalette([10, 20, 30, 200, 100, 50] + [0, 0, 0] * 254)
    image.putpixel((1, 0), 1)
    return encode(image, "PNG", transparency=0), (1, 0)


def test_palette_png_with_transparency_composites_over_white() -> None:
    data, opaque_xy = _palette_with_transparency()
    result = canonical(data)
    assert_rgb8(result, (4, 2))
    x, y = opaque_xy
    assert tuple(result.pixels[y, x]) == (200, 100, 50)
    assert tuple(result.pixels[0, 0]) == (255, 255, 255), "transparent palette entry must become white"


def test_rgba_alpha_is_composited_over_white() -> None:
    image = Image.new("RGBA", (3, 1))
    image.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent
    image.putpixel((1, 0), (10, 20, 30, 255))  # opaque
    image.putpixel((2, 0), (0, 0, 0, 128))  # half-transparent black
    result = canonical(encode(image, "PNG"))
    assert_rgb8(result, (3, 1))
    assert tuple(result.pixels[0, 0]) == (255, 255, 255), "fully transparent must become white"
    assert tuple(result.pixels[0, 1]) == (10, 20, 30)
    assert all(120 <= v <= 135 for v in result.pixels[0, 2]), result.pixels[0, 2]


def test_la_alpha_is_composited_over_white() -> None:
    image = Image.new("LA", (2, 1))
    image.putpixel((0, 0), (0, 0))
    image.putpixel((1, 0), (60, 255))
    result = canonical(encode(image, "PNG"))
    assert_rgb8(result, (2, 1))
    assert tuple(result.pixels[0, 0]) == (255, 255, 255)
    assert tuple(result.pixels[0, 1]) == (60, 60, 60)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_greyscale_is_scaled_not_clipped(fmt: str) -> None:
    values = np.array([[0, 200, 257, 32768, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    result = canonical(encode(image, fmt))
    assert_rgb8(result, (5, 1))
    grey = result.pixels[0, :, 0].tolist()
    assert grey == [0, 1, 1, 128, 255], f"16-bit values must scale by 255/65535, got {grey}"
    assert np.array_equal(result.pixels[..., 0], result.pixels[..., 1])
    assert np.array_equal(result.pixels[..., 0], result.pixels[..., 2])


def test_cmyk_jpeg_becomes_rgb() -> None:
    result = canonical(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=100))
    assert_rgb8(result, (8, 8))
    red, green, blue = (int(v) for v in result.pixels[4, 4])
    assert red > 240 and green < 15 and blue < 15, (red, green, blue)


def test_animated_gif_uses_the_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    with Image.open(io.BytesIO(data)) as check:
        assert check.n_frames == 3
    result = canonical(data)
    assert_rgb8(result, (8, 8))
    assert {tuple(p) for p in result.pixels.reshape(-1, 3).tolist()} == {(255, 0, 0)}


@pytest.mark.parametrize(
    ("mode", "fmt", "params"),
    [
        ("RGB", "TIFF", {}),
        ("RGB", "TIFF", {"compression": "tiff_lzw"}),
        ("RGB", "BMP", {}),
        ("RGB", "GIF", {}),
        ("RGB", "WEBP", {"lossless": True}),
        ("RGB", "JPEG", {}),
        ("L", "PNG", {}),
        ("L", "JPEG", {}),
        ("1", "PNG", {}),
        ("1", "BMP", {}),
        ("1", "TIFF", {}),
        ("P", "BMP", {}),
        ("RGBA", "TIFF", {}),
        ("RGBA", "WEBP", {"lossless": True}),
        ("I", "TIFF", {}),
        ("F", "TIFF", {}),
    ],
)
def test_every_supported_mode_gives_uint8_rgb(
    small_photo: Image.Image, mode: str, fmt: str, params: dict[str, object]
) -> None:
    source = small_photo if mode == "RGB" else small_photo.convert(mode)
    result = canonical(encode(source, fmt, **params))
    assert_rgb8(result, small_photo.size)


def test_one_bit_image_is_black_and_white() -> None:
    image = Image.new("1", (2, 1), 0)
    image.putpixel((1, 0), 1)
    result = canonical(encode(image, "PNG"))
    assert_rgb8(result, (2, 1))
    assert result.pixels[0].tolist() == [[0, 0, 0], [255, 255, 255]]


# --------------------------------------------------------------------------- refused images


def _truncated(data: bytes, fraction: float) -> bytes:
    return data[: int(len(data) * fraction)]


BAD_IMAGES: dict[str, tuple[Callable[[Callable[[str], bytes]], bytes], set[str]]] = {
    "zero-bytes": (lambda _: b"", {"empty_file"}),
    "text-file": (lambda _: b"Hello, where is my order? This is a plain text file.\n" * 20, {"not_an_image"}),
    "random-bytes": (lambda _: np.random.default_rng(1234).bytes(8192), {"not_an_image"}),
    "html": (lambda _: b"<!doctype html><html><body><img src=x></body></html>", {"not_an_image"}),
    "pdf-like": (
        lambda _: b"%PDF-1.4\n1 0 obj<< /Type /Catalog >>endobj\ntrailer<<>>\n%%EOF\n",
        {"not_an_image"},
    ),
    "png-signature-only": (lambda _: b"\x89PNG\r\n\x1a\n", {"not_an_image", "corrupt_image"}),
    "truncated-png-half": (
        lambda get: _truncated(get("chelsea.png"), 0.5),
        {"corrupt_image", "not_an_image"},
    ),
    "truncated-png-header": (lambda get: get("chelsea.png")[:60], {"corrupt_image", "not_an_image"}),
    "truncated-jpeg-half": (
        lambda get: _truncated(get("rocket.jpg"), 0.5),
        {"corrupt_image", "not_an_image"},
    ),
    "truncated-jpeg-header": (lambda get: get("rocket.jpg")[:200], {"corrupt_image", "not_an_image"}),
    "ico": (lambda _: encode(Image.new("RGB", (16, 16), "red"), "ICO"), {"unsupported_format"}),
    "ppm": (lambda _: encode(Image.new("RGB", (16, 16), "red"), "PPM"), {"unsupported_format"}),
    "tga": (lambda _: encode(Image.new("RGB", (16, 16), "red"), "TGA"), {"unsupported_format"}),
    "real-pdf": (lambda _: encode(Image.new("RGB", (16, 16), "red"), "PDF"), {"not_an_image"}),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_refused_with_a_clear_code(case: str, photo_bytes: Callable[[str], bytes]) -> None:
    make, codes = BAD_IMAGES[case]
    with pytest.raises(InvalidInputError) as caught:
        canonical(make(photo_bytes))
    assert caught.value.code in codes, f"{case}: got {caught.value.code!r}, expected one of {codes}"
    assert_user_facing(caught.value)


@pytest.mark.parametrize("raw", [None, "a string", 42, [b"\x89PNG"]])
def test_non_bytes_upload_is_refused(raw: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        canonical(raw)  # type: ignore[arg-type]
    assert caught.value.code == "not_an_image"
    assert_user_facing(caught.value)


def test_file_over_the_byte_limit_is_refused_before_decoding(small_photo: Image.Image) -> None:
    data = encode(small_photo, "PNG")
    limit = len(data) - 1
    with pytest.raises(InvalidInputError) as caught:
        canonical(data, max_bytes=limit)
    assert caught.value.code == "file_too_large"
    assert_user_facing(caught.value)
    assert "MB" in caught.value.message
    assert canonical(data, max_bytes=len(data)).shape[:2] == (48, 64), "exactly at the limit is allowed"


def test_file_over_the_default_limit_is_refused_without_decoding() -> None:
    data = b"\x89PNG\r\n\x1a\n" + b"\x00" * MAX_BYTES
    with pytest.raises(InvalidInputError) as caught:
        canonical(data)
    assert caught.value.code == "file_too_large"
    assert f"{MAX_BYTES / 1e6:.1f} MB" in caught.value.message


def test_pixel_limit_is_inclusive(small_photo: Image.Image) -> None:
    data = encode(small_photo, "PNG")
    pixels = small_photo.width * small_photo.height
    assert canonical(data, max_pixels=pixels).shape == (48, 64, 3)
    with pytest.raises(InvalidInputError) as caught:
        canonical(data, max_pixels=pixels - 1)
    assert caught.value.code == "image_too_large"
    assert_user_facing(caught.value)
    assert "64 x 48" in caught.value.message, caught.value.message


BOMB_SIDE = 20_000


def test_decompression_bomb_header_is_refused_without_allocating() -> None:
    data = png_header_only(BOMB_SIDE, BOMB_SIDE)
    assert len(data) < 500, "the crafted file itself must be tiny"
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(InvalidInputError) as caught:
            canonical(data)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.code == "image_too_large"
    assert_user_facing(caught.value)
    assert peak < 50 * 1024 * 1024, f"peak traced memory {peak / 1e6:.1f} MB: pixels were allocated"
    assert elapsed < 1.0, f"refusing a header took {elapsed:.2f} s"


def test_decompression_bomb_header_does_not_grow_the_process() -> None:
    """tracemalloc misses Pillow's C allocations: measure a fresh process's peak RSS too."""
    script = (
        "import resource, sys\n"
        "from engine.inputs import canonicalize_image\n"
        "from engine.errors import InvalidInputError\n"
        "data = sys.stdin.buffer.read()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        f"    canonicalize_image(data, max_bytes={MAX_BYTES}, max_pixels={MAX_PIXELS})\n"
        "except InvalidInputError as exc:\n"
        "    code = exc.code\n"
        "else:\n"
        "    code = 'accepted'\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(code, after - before)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=png_header_only(BOMB_SIDE, BOMB_SIDE),
        capture_output=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=True,
    )
    code, grown_kib = done.stdout.decode().split()
    assert code == "image_too_large"
    assert int(grown_kib) < 50 * 1024, f"peak RSS grew by {int(grown_kib) / 1024:.0f} MiB"


@pytest.mark.parametrize(
    ("width", "height", "max_pixels"),
    [
        (BOMB_SIDE, BOMB_SIDE, MAX_PIXELS),  # 400 Mpx: above Pillow's own bomb limit too
        (10_000, 10_000, MAX_PIXELS),  # 100 Mpx: between Pillow's warning and error limits
        (8_000, 8_000, MAX_PIXELS),  # 64 Mpx: above our limit, below Pillow's
        (2_000, 1_000, 1_000_000),
    ],
)
def test_too_many_pixels_message_mentions_the_image_size(width: int, height: int, max_pixels: int) -> None:
    with pytest.raises(InvalidInputError) as caught:
        canonical(png_header_only(width, height), max_pixels=max_pixels)
    assert caught.value.code == "image_too_large"
    assert_user_facing(caught.value)
    message = caught.value.message
    assert f"{max_pixels / 1e6:.0f} megapixels" in message, message
    # Above twice Pillow's own limit only the pixel count is known before decoding.
    assert f"{width:,} x {height:,}" in message or f"{width * height:,} pixels" in message, (
        f"a {width} x {height} image must be refused with its size in the message; got {message!r}"
    )


def test_pixel_limit_comes_from_the_argument_not_from_pillow() -> None:
    """MAX_IMAGE_PIXELS may be set above Pillow's default bomb limit (about 89.5 Mpx).

    A 9,500 x 9,500 header (90.25 Mpx) is under a 100 Mpx limit, so it must not be
    refused as too large (its pixel data is fake, so it is refused as corrupt).
    """
    with pytest.raises(InvalidInputError) as caught:
        canonical(png_header_only(9_500, 9_500), max_pixels=100_000_000)
    assert caught.value.code == "corrupt_image", (
        f"9,500 x 9,500 under max_pixels=100,000,000 refused as {caught.value.code!r}: "
        f"{caught.value.message!r} (Pillow's global bomb limit overrides the setting)"
    )


# --------------------------------------------------------------------------- text


def cleaned(raw: object, max_chars: int = MAX_CHARS) -> str:
    result = clean_text(raw, max_chars=max_chars)
    assert isinstance(result, CanonicalText)
    return result.text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("ＷＨＥＲＥ ｉｓ my order", "WHERE is my order"),  # full-width letters
        ("the ﬁle is ﬂawed", "the file is flawed"),  # ligatures
        ("order №５ ①", "order No5 1"),
        ("caf\u0065\u0301", "café"),  # combining accent composed
        ("hello\x00world\x07\x1b[31m!", "helloworld[31m!"),  # C0 controls dropped
        ("a\x7fb\x85c", "ab c"),  # DEL dropped; NEL is whitespace
        ("abc\u202edcba", "abcdcba"),  # right-to-left override
        ("\u202aleft\u202c \u2067iso\u2069 \u200emark\u200f", "left iso mark"),
        ("zero\u200bwidth\ufeffbom", "zerowidthbom"),  # other format characters
        ("  tabs\tand\t\tnewlines\n\r\nhere  ", "tabs and newlines here"),
        ("non\u00a0breaking\u2003em\u3000ideographic", "non breaking em ideographic"),
        ("line\u2028sep\u2029para", "line sep para"),
        ("word \x00 word", "word word"),  # a control between spaces leaves one space
    ],
)
def test_text_is_normalised(raw: str, expected: str) -> None:
    assert cleaned(raw) == expected


def test_clean_text_is_idempotent() -> None:
    raw = " ＡＢＣ\u202e\tﬁne\x00  \u00a0done "
    once = cleaned(raw)
    assert cleaned(once) == once


@pytest.mark.parametrize(
    "raw",
    [
        "",
        " ",
        "\t\n\r \u00a0\u3000",
        "\x00\x01\x02\x7f",
        "\u202e\u202d\u200e",
        "\ufeff\u200b",
        " \x00 \t\u202e ",
        "\ud800\udfff",
    ],
)
def test_empty_text_is_refused(raw: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        clean_text(raw, max_chars=MAX_CHARS)
    assert caught.value.code == "empty_text"
    assert_user_facing(caught.value)


@pytest.mark.parametrize("limit", [10, MAX_CHARS])
def test_text_over_the_limit_is_refused(limit: int) -> None:
    assert cleaned("x" * limit, max_chars=limit) == "x" * limit, "exactly at the limit is allowed"
    with pytest.raises(InvalidInputError) as caught:
        clean_text("x" * (limit + 1), max_chars=limit)
    assert caught.value.code == "text_too_long"
    assert_user_facing(caught.value)
    assert f"{limit:,}" in caught.value.message, caught.value.message


def test_limit_applies_after_whitespace_collapse() -> None:
    raw = "word" + " " * 30 + "word"
    assert cleaned(raw, max_chars=9) == "word word"


def test_megabyte_text_is_refused_quickly() -> None:
    raw = "spam " * 200_000 + "ﬁ" * 48_576
    assert len(raw) >= 1_000_000
    start = time.perf_counter()
    with pytest.raises(InvalidInputError) as caught:
        clean_text(raw, max_chars=MAX_CHARS)
    elapsed = time.perf_counter() - start
    assert caught.value.code == "text_too_long"
    assert_user_facing(caught.value)
    assert elapsed < 0.1, f"refusing 1 MB of text took {elapsed:.3f} s"


@pytest.mark.parametrize(
    "text",
    [
        "Где мой заказ? Я жду уже неделю",  # Russian
        "我的订单在哪里 我想退款",  # Chinese
        "أين طلبي؟ أريد استرداد المال",  # Arabic
        "मेरा ऑर्डर कहाँ है",  # Hindi
        "می\u200cخواهم سفارشم را لغو کنم",  # Persian, with a zero-width non-joiner
        "Ελληνικά και 日本語のテキスト",
        "great service 👍🎉",
        "family 👨\u200d👩\u200d👧\u200d👦 and flag 🇫🇷 and wave 👋🏽",
        "I ❤️ this",
    ],
)
def test_non_latin_scripts_and_emoji_are_kept(text: str) -> None:
    assert unicodedata.is_normalized("NFKC", text), "test data must already be NFKC"
    assert cleaned(text) == text


def test_zwj_sequence_keeps_its_joiners() -> None:
    family = "👨\u200d👩\u200d👧"
    assert cleaned(f"look {family}").count("\u200d") == 2


@pytest.mark.parametrize("raw", ["abc\ud800def", "\udfffstart", "end\udbff", "a\udc00\ud800b"])
def test_lone_surrogates_do_not_crash(raw: str) -> None:
    result = cleaned(raw)
    result.encode("utf-8")  # must be encodable: it is hashed and stored
    assert result.replace(" ", "").isalpha()


@pytest.mark.parametrize("raw", [None, b"where is my order", 42, 3.5, ["hi"], {"text": "hi"}])
def test_non_str_text_is_refused(raw: object) -> None:
    with pytest.raises(InvalidInputError) as caught:
        clean_text(raw, max_chars=MAX_CHARS)
    assert caught.value.code == "not_text"
    assert_user_facing(caught.value)


def test_canonical_text_fingerprint_is_utf8() -> None:
    result = clean_text("  Привет  мир ", max_chars=MAX_CHARS)
    assert result.fingerprint_parts() == (b"text:", "Привет мир".encode())
    assert digest_parts(result.fingerprint_parts()) == digest_parts(
        clean_text("Привет\tмир", max_chars=MAX_CHARS).fingerprint_parts()
    )
