"""MoE bytes per rank, the gather path against the all-to-all dispatch, for the same batch:
`python benchmarks/moe_a2a.py [tokens-per-rank ...]`.

A two-layer Qwen3-MoE (transformers save_pretrained, random weights) with 64 experts, top-8,
hidden 512, at tp 4 dp 4 ep 4 (attention TP 1, so attention moves nothing): each DP rank
prefills one prompt of T tokens. The figures are layer 0's MoE (the terminal layer's sum is
an all-reduce on the gather path, not a reduce-scatter): the gather path all-gathers every DP
rank's rows at hidden width before it and the next input reduce-scatters its sum; the
all-to-all path exchanges counts, sends each token once to each other rank holding one of
its chosen experts (with its ids and weights) and gets one weighted row back from each.
Rank 0's ledger bytes for the prefill (what it sends); both runs must give the same tokens.
Prints one JSON line per T.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

CONFIG = dict(vocab_size=256, hidden_size=512, intermediate_size=512, moe_intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
              num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
              max_position_embeddings=1024)


def checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).save_pretrained(path)
    return path


def moe_bytes(model_dir: Path, tokens: int, backend: str) -> dict:
    from layer_boundary.engine.run_command import rank_entry
    from layer_boundary.engine.runner import RunSpec, merge
    from layer_boundary.runtime.launch import spawn

    prompts = tuple(tuple((31 * r + 7 * t + 3) % CONFIG["vocab_size"] for t in range(tokens))
                    for r in range(4))
    spec = RunSpec(str(model_dir), tp=4, dp=4, ep=4, prompts=prompts, max_new_tokens=1,
                   moe_a2a_backend=backend)
    results = spawn(rank_entry, 4, spec)
    sites = ("layer0.ffn.prepare", "layer0.ffn.compute", "layer1.attn.prepare")
    moe = [e for e in results[0].ledger if e.step == 0 and e.site in sites]
    return {"generation": merge(results), "bytes": sum(e.bytes for e in moe),
            "collectives": len(moe)}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = checkpoint(Path(tmp) / "qwen3_moe_64x8")
        for tokens in [int(t) for t in sys.argv[1:]] or [1, 2, 4, 16, 64, 256]:
            gathered = moe_bytes(model_dir, tokens, "none")
            dispatched = moe_bytes(model_dir, tokens, "all_to_all")
            a, b = gathered.pop("generation"), dispatched.pop("generation")
            assert a.generated == b.generated, (a.generated, b.generated)
            print(json.dumps({"tokens_per_rank": tokens, "gather_bytes": gathered["bytes"],
                              "gather_collectives": gathered["collectives"],
                              "all_to_all_bytes": dispatched["bytes"],
                              "all_to_all_collectives": dispatched["collectives"],
                              "ratio": dispatched["bytes"] / gathered["bytes"]}), flush=True)
    sys.exit(0)
