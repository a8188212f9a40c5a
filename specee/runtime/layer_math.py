"""A Llama decoder layer's elementwise math, written once for the compiled layer step
(specee/runtime/compiled.py) and the walk that decides exits on the device (specee/runtime/device_walk.py)."""
from __future__ import annotations

import torch

# The Hugging Face norm classes that compute weight * h / rms(h), the one list of them: the compiled
# step and the device walk run them with rms_norm below, and SpecEE's probe folds their weight into
# the speculative tokens' LM-head rows (specee/early_exit/features.py).
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def rms_norm(h, w, eps: float):
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(h.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)
