"""RMSNorm with an fp32 entry point for boundary reads that accumulate in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim without a weight, the statistic in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_fp32(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``x32 * rsqrt(mean(x32 ** 2) + eps)`` over the last dim, in one fused op (torch's
    ``rms_norm``; on the CPU bit for bit what transformers' three ops compute, in fewer
    passes over the rows)."""
    return F.rms_norm(x32, (x32.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it (Llama, Qwen3): normalise in fp32, round to the
    input dtype, then scale by ``weight``; ``normalize_fp32`` takes the boundary's fp32 sum."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def normalize_fp32(self, x32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Normalise an fp32 tensor and round once to ``out_dtype`` (as HF: round, then scale)."""
        return self.weight * rms_fp32(x32, self.eps).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize_fp32(x.float(), x.dtype)


class GemmaRMSNorm(nn.Module):
    """The zero-centered RMSNorm (Gemma, Qwen3-Next, Qwen3.5): ``norm(x) * (1 + w)`` with the
    scale applied in fp32 before the one rounding (HF: ``(x * (1 + w)).to(dtype)``), unlike
    ``RMSNorm``, which rounds and then scales. The stored weight is ``w`` (zeros: identity),
    also readable as ``gemma_weight`` for fused kernels that take the zero-centered form."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    @property
    def gemma_weight(self) -> torch.Tensor:
        return self.weight

    def normalize_fp32(self, x32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Normalise an fp32 tensor, scale by ``1 + w`` in fp32, round once to ``out_dtype``."""
        return gemma_rms_fp32(x32, self.weight, self.eps, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize_fp32(x.float(), x.dtype)


def gemma_rms_fp32(x32: torch.Tensor, gemma_weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``GemmaRMSNorm`` of an fp32 tensor with its zero-centered weight ``gemma_weight``: what
    a fused terminal kernel computes from the ``gemma_weight`` it is handed."""
    return (rms_fp32(x32, eps) * (1.0 + gemma_weight.float())).to(out_dtype)
