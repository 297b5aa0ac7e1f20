"""The attention input gather at DeepSeek-V3's real MLA widths, ordinary against input-scattered:
`python benchmarks/input_scattered.py [tokens ...]`.

Under rs an ordinary batch all-gathers each attention's normed input at hidden width (7168);
an input-scattered batch runs the qkv latent (q_a 1536, kv_a 512 + rope 64) on the scattered
rows first and gathers only that: 2112 channels, 0.29 of the bytes. The checkpoint is a
transformers save_pretrained DeepseekV3ForCausalLM with the real hidden and latent widths
(few heads, experts and layers, since only the widths set the gather's size), run at tp 2 on
gloo. Both runs must give the same tokens (the logits' largest difference is printed); the
figures are the ledger's, from one run each.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

REAL_MLA = dict(hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128)
SMALL_REST = dict(vocab_size=256, intermediate_size=512, moe_intermediate_size=64,
                  num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                  num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=512)


def checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**REAL_MLA, **SMALL_REST,
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e4})
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    return path


def attention_gathers(model_dir: Path, tokens: int, scattered: bool) -> dict:
    from layer_boundary.engine.runner import RunSpec, merge
    from layer_boundary.runtime.launch import spawn

    from layer_boundary.engine.run_command import rank_entry

    prompt = tuple((7 * t + 3) % SMALL_REST["vocab_size"] for t in range(tokens))
    spec = RunSpec(str(model_dir), tp=2, boundary_reduction="rs", prompts=(prompt,),
                   max_new_tokens=1, attn_input_scattered=scattered)
    results = spawn(rank_entry, 2, spec)
    gathers = [e for e in results[0].ledger if e.step == 0 and e.kind == "all_gather"
               and ".attn" in e.site and e.site.endswith("prepare")]
    rows = -(-tokens // 2) * 2  # rs pads the rows to whole attention-TP chunks
    return {"generation": merge(results), "bytes": sum(e.bytes for e in gathers),
            "width": sorted({e.numel // rows for e in gathers}), "gathers": len(gathers)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = checkpoint(Path(tmp) / "deepseek_v3_real_mla")
        for tokens in [int(t) for t in sys.argv[1:]] or [64, 512]:
            hidden = attention_gathers(model_dir, tokens, False)
            latent = attention_gathers(model_dir, tokens, True)
            a, b = hidden.pop("generation"), latent.pop("generation")
            assert a.generated == b.generated, (a.generated, b.generated)
            diff = max((x - y).abs().max().item() for p, q in zip(a.logits, b.logits)
                       for x, y in zip(p, q))
            print(json.dumps({"tokens": tokens, "attention_gathers": hidden["gathers"],
                              "hidden_width": hidden["width"], "hidden_bytes": hidden["bytes"],
                              "latent_width": latent["width"], "latent_bytes": latent["bytes"],
                              "ratio": latent["bytes"] / hidden["bytes"],
                              "max_logit_diff": diff}), flush=True)
    sys.exit(0)
