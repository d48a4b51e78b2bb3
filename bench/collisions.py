"""Pairs of different inputs with one xxh3-128 digest, built from the hash's structure.

Cache keys used to be unkeyed xxh3-128 digests. xxh3 is fast but not collision resistant:
for inputs over 240 bytes each 64-byte stripe adds every 8-byte lane `d` to one accumulator
and `lo32(d ^ s) * hi32(d ^ s)` to its neighbour, `s` being the lane's 8 bytes of the
algorithm's fixed secret. A lane whose low 4 bytes equal the secret's adds a product of zero,
so only `d` itself counts, and two such lanes of one accumulator in one 1 KB block (before
the accumulators are scrambled) can move their high halves by +delta and -delta without
changing any accumulator: a collision, with free choice of delta. Doing this for every pair
of stripes in every block changes about a quarter of the bytes.

Used by tests/test_keys.py and the `collision` fault scenario to plant such pairs on the
cache; nothing here is used by the app.
"""

from __future__ import annotations

import io
import random

import numpy as np
import xxhash
from PIL import Image

# XXH3's default secret (kSecret in the xxHash specification): a constant of the algorithm.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
STRIPE = 64
LANES = 8
STRIPES_PER_BLOCK = (len(XXH3_SECRET) - STRIPE) // 8  # 16
BLOCK = STRIPE * STRIPES_PER_BLOCK  # 1024


def colliding_streams(stream: bytes, *, start: int, seed: int = 0) -> tuple[bytes, bytes]:
    """Two byte strings, equal to `stream` before `start`, different after it, with one
    xxh3-128 digest. Only whole 1 KB blocks that end before the final stripe are changed,
    so `stream` needs at least 1 KB past `start` (plus 64 bytes)."""
    rng = random.Random(seed)
    a = bytearray(stream)
    b = bytearray(stream)
    changed = 0
    full_blocks = (len(stream) - 1) // BLOCK
    for block in range(full_blocks):
        base = block * BLOCK
        if base + BLOCK > len(stream) - STRIPE:
            break  # the final stripe (the last 64 bytes) is accumulated a second time
        for first in range(0, STRIPES_PER_BLOCK, 2):
            for lane in range(LANES):
                spots = [base + (first + k) * STRIPE + lane * 8 for k in (0, 1)]
                if min(spots) < start:
                    continue
                for k, spot in enumerate(spots):
                    secret_at = (first + k) * 8 + lane * 8
                    a[spot : spot + 4] = XXH3_SECRET[secret_at : secret_at + 4]  # a zero product
                    b[spot : spot + 4] = a[spot : spot + 4]
                delta = rng.randrange(1, 2**32)
                hi_1 = int.from_bytes(a[spots[0] + 4 : spots[0] + 8], "little")
                hi_2 = int.from_bytes(a[spots[1] + 4 : spots[1] + 8], "little")
                b[spots[0] + 4 : spots[0] + 8] = ((hi_1 + delta) % 2**32).to_bytes(4, "little")
                b[spots[1] + 4 : spots[1] + 8] = ((hi_2 - delta) % 2**32).to_bytes(4, "little")
                changed += 1
    if not changed:
        raise ValueError("the stream is too short to plant a collision after `start`")
    a_bytes, b_bytes = bytes(a), bytes(b)
    assert a_bytes != b_bytes and xxhash.xxh3_128_digest(a_bytes) == xxhash.xxh3_128_digest(b_bytes)
    return a_bytes, b_bytes


def pixel_pair(height: int = 64, width: int = 64, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two different RGB pictures whose canonical fingerprints (the shape header, then the
    pixels: engine.inputs.CanonicalImage) share an xxh3-128 digest."""
    header = f"rgb8:{height}x{width}x3:".encode()
    noise = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    a, b = colliding_streams(header + noise.tobytes(), start=len(header), seed=seed)
    return tuple(np.frombuffer(s[len(header) :], dtype=np.uint8).reshape(height, width, 3) for s in (a, b))


def png_pair(height: int = 64, width: int = 64, *, seed: int = 0) -> tuple[bytes, bytes]:
    """`pixel_pair` as two PNG files: the canonical key of the pair used to collide."""
    return tuple(_encode(pixels, "PNG") for pixels in pixel_pair(height, width, seed=seed))


def bmp_upload_pair(height: int = 48, width: int = 48, *, seed: int = 0) -> tuple[bytes, bytes]:
    """Two BMP files (uncompressed, no checksum) of different pictures whose bytes, hashed as
    a raw upload (`b"bytes:"` then the file: engine.cache.keys.raw_digest), used to collide: the
    raw alias of one answered for the other."""
    noise = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    template = _encode(noise, "BMP")
    pixel_start = int.from_bytes(template[10:14], "little")  # BMP header: offset of the pixel array
    tag = b"bytes:"
    a, b = colliding_streams(tag + template, start=len(tag) + pixel_start, seed=seed)
    return a[len(tag) :], b[len(tag) :]


def text_pair(filler: str = "please help me with my account ", *, length: int = 1200) -> tuple[str, str]:
    """Two different messages whose raw digests (`b"str:"` then UTF-8: engine.cache.keys.raw_digest)
    used to collide, so the second was answered from the first's raw alias.

    Text must stay valid UTF-8, and no aligned 4-byte window of the secret is plain text, so
    the zero-product lanes are where the secret's window is the middle of a character: lane 2
    of stripes 0 and 1, whose high halves (secret bytes 20-23 and 28-31) become U+C3417 U+06C0
    and U+0DF3 'g' U+001F with a lead byte before them and a continuation byte after. Their low
    halves then move by +1 and -1 (one ASCII letter each)."""
    tag = b"str:"
    body = bytearray((filler * (length // len(filler) + 1))[:length].encode())
    stream = bytearray(tag) + body
    fixed = {19: b"\xf1", 20: XXH3_SECRET[20:24], 24: b"\x80", 83: b"\xe0", 84: XXH3_SECRET[28:32]}
    for at, data in fixed.items():
        stream[at : at + len(data)] = data
    stream[16:19] = b"mmm"  # low half of stripe 0, lane 2 (its 4th byte is the lead above)
    stream[80:83] = b"mmm"  # low half of stripe 1, lane 2
    other = bytearray(stream)
    other[16] += 1  # "n": +1 on one lane...
    other[80] -= 1  # "l": ...-1 on the other, one accumulator: the sum is unchanged
    a, b = bytes(stream), bytes(other)
    assert xxhash.xxh3_128_digest(a) == xxhash.xxh3_128_digest(b)
    return a[len(tag) :].decode(), b[len(tag) :].decode()


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()
