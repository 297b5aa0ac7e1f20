"""RMSNorm and LayerNorm with an fp32 entry point for boundary reads that accumulate in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .arguments import flag, positive_int, positive_number
from .collectives import all_reduce_rows
from .ledger import statistics_site


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim without a weight, the statistic in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_fp32(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``x32 * rsqrt(mean(x32 ** 2) + eps)`` over the last dim, in one fused op (torch's
    ``rms_norm``; on the CPU bit for bit what transformers' three ops compute, in fewer
    passes over the rows)."""
    return F.rms_norm(x32, (x32.shape[-1],), eps=eps)


def _eps(norm, size, eps, size_name: str = "hidden_size") -> float:
    """A norm's ``eps``, checked as config.json's epsilons are (a positive, finite number: a
    NaN made every output NaN, a bool was read as 1), and its width (a positive integer)."""
    positive_int(type(norm).__name__, size_name, size)
    return positive_number(type(norm).__name__, "eps", eps)


class RMSNorm(nn.Module):
    """RMSNorm as transformers computes it (Llama, Qwen3): normalise in fp32, round to the
    input dtype, then scale by ``weight``; ``normalize_fp32`` takes the boundary's fp32 sum."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = _eps(self, hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def normalize_fp32(self, x32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Normalise an fp32 tensor and round once to ``out_dtype`` (as HF: round, then scale)."""
        return self.weight * rms_fp32(x32, self.eps).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize_fp32(x.float(), x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm computed in fp32, its weight (and bias, where it has one) applied in fp32, the
    result rounded once: Cohere's ``CohereLayerNorm`` (no bias) and, in fp32, GPT-NeoX's
    ``nn.LayerNorm``; ``normalize_fp32`` takes the boundary's fp32 sum. Per token, and an
    empty batch of rows is fine."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 dtype=torch.float32):
        super().__init__()
        self.eps, self.shape = _eps(self, hidden_size, eps), (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
                     if bias else None)

    def normalize_fp32(self, x32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x32, self.shape, self.weight.float(), bias, self.eps).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize_fp32(x.float(), x.dtype)


class Fp32ScaleRMSNorm(nn.Module):
    """RMSNorm as OLMo-2 computes it: the weight scales the fp32 normalised value and the
    product is rounded once (``RMSNorm`` rounds, then scales: the same numbers in fp32, not in
    bf16). Its own class, so nothing that stands in for ``RMSNorm`` takes it for one."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = _eps(self, hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def normalize_fp32(self, x32: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Normalise an fp32 tensor, scale in fp32, round once to ``out_dtype``."""
        return (self.weight.float() * rms_fp32(x32, self.eps)).to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize_fp32(x.float(), x.dtype)


class GemmaRMSNorm(nn.Module):
    """The zero-centered RMSNorm (Gemma, Qwen3-Next, Qwen3.5): ``norm(x) * (1 + w)`` with the
    scale applied in fp32 before the one rounding (HF: ``(x * (1 + w)).to(dtype)``), unlike
    ``RMSNorm``, which rounds and then scales. The stored weight is ``w`` (zeros: identity),
    also readable as ``gemma_weight`` for fused kernels that take the zero-centered form."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = _eps(self, hidden_size, eps)
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


class HeadsRMSNorm(nn.Module):
    """RMSNorm over every head of a projection whose heads are split over ``group`` (OLMo-2's
    and MiniMax-M2's q/k norms span ``heads * head_dim``): each rank holds its heads' slice of
    the weight and sums its squares with the other ranks'. Where a head is replicated on
    ``replicas`` consecutive ranks (kv heads fewer than the ranks), the group's sum counts
    each head ``replicas`` times and is divided back. Rounding as ``RMSNorm`` (``scale_fp32``
    False: round, then scale) or OLMo-2's (True: scale in fp32, round once).

    Args:
        heads: the projection's heads in all; head_dim: their width.
        group: the ranks its heads are split over (attention TP).
        eps: the norm's epsilon.
        replicas: consecutive ranks holding the same heads (``QKVParallelLinear.kv_replicas``).
        scale_fp32: where the weight multiplies (see above).
    """

    def __init__(self, heads: int, head_dim: int, group, eps: float, *, replicas: int = 1,
                 scale_fp32: bool = False, dtype=torch.float32) -> None:
        super().__init__()
        positive_int(type(self).__name__, "heads", heads)
        eps = _eps(self, head_dim, eps, "head_dim")
        flag(type(self).__name__, "scale_fp32", scale_fp32)
        self.group, self.eps, self.replicas, self.scale_fp32 = group, eps, replicas, scale_fp32
        self.features = heads * head_dim
        local_heads = max(1, heads * replicas // group.size)
        self.local = local_heads * head_dim
        self.weight = nn.Parameter(torch.ones(self.local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded: torch.Tensor) -> None:
        start = (self.group.rank // self.replicas) * self.local
        param.data.copy_(loaded[start:start + self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.square().sum(-1, keepdim=True)
        if self.group.size > 1:
            # a statistic, not a contribution: the exactly-once audit leaves it out
            squares = all_reduce_rows(squares, self.group, site=statistics_site())
            if self.replicas > 1:
                squares = squares / self.replicas
        normed = x32 * torch.rsqrt(squares / self.features + self.eps)
        if self.scale_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)
