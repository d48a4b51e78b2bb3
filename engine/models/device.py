"""Device choice from the DEVICE setting."""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError


def select_device(preference: str) -> torch.device:
    """auto: CUDA when available, else CPU; cuda: CUDA or a clear error; cpu: CPU."""
    if preference == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if preference == "cuda":
        raise ModelLoadError("DEVICE=cuda was requested but CUDA is not available on this machine.")
    return torch.device("cpu")


def describe(device: torch.device) -> str:
    """A stable, human-readable name: 'cpu' or 'cuda:0'."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return device.type


def in_owned_memory(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every weight copied into memory the process owns. transformers maps
    safetensors files into memory, so a loaded model reads its weights from the file for
    as long as it lives: an operator copying new weights over the file in place would
    change the *served* model while its version still names the old weights (seen in the
    `model_reload` fault scenario). On a GPU the weights are copies already."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()
    return model
