"""Qwen3 (dense) with layer boundaries: Llama's decoder (``llama.py``) with a per-head RMSNorm
on q and k, the default rope only, and FP8 checkpoints read. Compute is plain PyTorch;
parameter names follow the Hugging Face checkpoint (q/k/v are stacked into ``qkv_proj`` at
load time)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import declare_attn, declare_ffn
from ..runtime.args import BoundaryRuntime
from .config import (CheckpointError, check_unquantized_silu, fp8_quantization,
                     quantized_read)
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM
from .registry import dense, register_model


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Llama's fields as Qwen3's config gives them (no MLP bias, the default rope), and an FP8
    checkpoint's quantization."""

    mlp_bias: bool = False  # Qwen3's MLP has none (config.json's is not read)
    # quantization_config (config.fp8_quantization): the FP8 weights' [out, in] block and the
    # modules left unquantized; None: an unquantized checkpoint
    fp8_block: tuple | None = None
    fp8_skip: tuple = ()
    model_type: str = "qwen3"

    checks = {}
    rope_types = ("default",)

    @classmethod
    def refuse(cls, cfg: dict) -> None:
        if cfg.get("use_sliding_window"):
            raise CheckpointError("config.json use_sliding_window=true is not supported")
        check_unquantized_silu(cfg, fp8=True)

    @classmethod
    def read(cls, cfg: dict) -> dict:
        block, skip = fp8_quantization(cfg)
        return dict(super().read(cfg), fp8_block=block, fp8_skip=skip)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with a per-head RMSNorm on q and k (``q_norm``, ``k_norm``); an FP8
    checkpoint's q/k/v and gate/up read quantized inputs."""

    qk_norm = True

    @classmethod
    def declarations(cls, cfg, index: int, runtime: BoundaryRuntime, layer=None) -> tuple:
        """GQA (PARTIAL), then the FFN; both sequence-parallel (their linears move the rows);
        an FP8 checkpoint's q/k/v read quantized inputs."""
        attn = declare_attn(sequence_parallel=True, read=quantized_read(
            cfg, index, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")))
        return attn, cls.ffn_declaration(cfg, index, runtime)

    @staticmethod
    def ffn_declaration(cfg, layer_id: int, runtime: BoundaryRuntime):
        """The FFN declaration of layer ``layer_id``: a gated MLP of column- and row-parallel
        linears, sequence-parallel."""
        return declare_ffn(sequence_parallel=True,
                           read=quantized_read(cfg, layer_id, ("mlp.gate_proj", "mlp.up_proj")))


@register_model("qwen3", Qwen3Config, architectures=("Qwen3ForCausalLM",), **dense())
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): Llama's model with the per-head q/k norms; q/k/v load stacked."""

    layer_cls = Qwen3DecoderLayer
