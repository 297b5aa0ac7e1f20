"""Every reference model's config from its tiny transformers config (no weights), and the
model built on virtual ranks on the meta device, as ``layer-boundary plan`` builds it: for tests
of what construction alone decides."""

from __future__ import annotations

import torch
from checkpoints import TINY, TINY_MOE
from checkpoints.cohere import TINY_COHERE, TINY_COHERE2
from checkpoints.ds import TINY_DS
from checkpoints.ds4 import TINY_DS4
from checkpoints.exaone4 import TINY_EXAONE4
from checkpoints.gemma3 import LAYER_TYPES, TINY_GEMMA3, WINDOW
from checkpoints.gpt_neox import TINY_NEOX
from checkpoints.granite import TINY_GRANITE, TINY_GRANITEMOE
from checkpoints.inkling import LAYERS as INKLING_LAYERS
from checkpoints.inkling import TINY_INKLING
from checkpoints.lc import TINY_LC
from checkpoints.nh import TINY_NH
from checkpoints.olmo import OLMO3_WINDOW, TINY_OLMO
from checkpoints.phi3 import TINY_PHI3
from checkpoints.qwen3_next import TINY_35, TINY_35_MOE, TINY_NEXT

from layer_boundary.models.registry import model_class
from layer_boundary.runtime import BoundaryRuntime, ParallelDims
from layer_boundary.runtime.parallel import virtual_parallel

# model_type -> (transformers config class, its fields): the cuts fall between every kind of
# neighbour (dense and sparse FFNs, a mixer before an FFN, a branch's merged output)
CONFIGS = {
    "qwen3": ("Qwen3Config", dict(TINY, num_hidden_layers=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(TINY_MOE, num_hidden_layers=4, mlp_only_layers=[0, 2])),
    "llama": ("LlamaConfig", dict(TINY, num_hidden_layers=4)),
    "deepseek_v3": ("DeepseekV3Config", dict(TINY_DS, num_hidden_layers=4,
                                             first_k_dense_replace=2)),
    "deepseek_v4": ("DeepseekV4Config", dict(TINY_DS4, num_hidden_layers=4,
                                             layer_types=["sliding_attention"] * 4,
                                             mlp_layer_types=["hash_moe", "moe"] * 2)),
    "longcat_flash": ("LongcatFlashConfig", dict(TINY_LC, num_layers=4)),
    "nemotron_h": ("NemotronHConfig", TINY_NH),  # 8 blocks: pp 2 cuts after the attention
    "qwen3_next": ("Qwen3NextConfig", TINY_NEXT),
    "qwen3_5_text": ("Qwen3_5TextConfig", TINY_35),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", TINY_35_MOE),
    # OLMo-2's layers (post norms, q/k norms over every head) with OLMo-3's sliding ones
    "olmo3": ("Olmo3Config", dict(TINY_OLMO, sliding_window=OLMO3_WINDOW)),
    # sandwich norms (input norms read, post norms as the producers' updates), a scaled embedding
    "gemma3_text": ("Gemma3TextConfig", dict(TINY_GEMMA3, sliding_window=WINDOW,
                                             layer_types=LAYER_TYPES)),
    # post norms without input norms; the full layer unroped beside the sliding ones
    "exaone4": ("Exaone4Config", dict(TINY_EXAONE4, sliding_window=WINDOW)),
    "granite": ("GraniteConfig", TINY_GRANITE),  # scaled residual updates, embedding, logits
    "granitemoe": ("GraniteMoeConfig", TINY_GRANITEMOE),
    "phi3": ("Phi3Config", TINY_PHI3),  # fused q/k/v and gate/up, partial rotary, a window
    # parallel blocks: the attention's partial joins the MLP's sum
    "cohere": ("CohereConfig", TINY_COHERE),
    "cohere2": ("Cohere2Config", TINY_COHERE2),
    "gpt_neox": ("GPTNeoXConfig", TINY_NEOX),
    # short convolutions as residual updates, applied on each DP rank's own rows
    "inkling_text": ("InklingTextConfig", dict(TINY_INKLING, **INKLING_LAYERS)),
}


def config(model_type: str):
    import transformers

    cls_name, fields = CONFIGS[model_type]
    raw = getattr(transformers, cls_name)(**fields).to_dict()
    model_cls = model_class(raw["model_type"])
    model_cls.config_class.validate(raw)
    return model_cls, model_cls.config_class.from_dict(raw)


def build(model_cls, cfg, tp: int, pp: int) -> list:
    """Each pipeline rank's model, as its first rank builds it."""
    dims = ParallelDims(world_size=pp * tp, tp=tp, pp=pp)
    models = []
    for stage in range(pp):
        runtime = BoundaryRuntime(virtual_parallel(dims, stage * tp), boundary_reduction="rs+rsv")
        with torch.device("meta"):  # boundaries are built at construction; no weights needed
            models.append(model_cls(cfg, runtime))
    return models
