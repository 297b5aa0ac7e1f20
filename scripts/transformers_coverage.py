"""Which transformers architectures the Transformers backend serves: for every causal-LM
type of the installed transformers whose config carries a ``base_model_tp_plan``, a tiny
random checkpoint through the generic path at world 1 against transformers (prefill at every
position, then cached decode steps) and at tp 2 against world 1 on gloo ranks. Each type runs
in its own process (a crash or a hang is that type's row, not the table's end).

    python scripts/transformers_coverage.py            # every type: writes docs/models.md's table
    python scripts/transformers_coverage.py qwen2 olmo # some types: prints their rows

A row says PASS (both comparisons within fp32 rounding), refused (the backend's reason:
nothing runs), FAIL (a comparison differs: a wrong number; none may be), or "no tiny
checkpoint" (transformers itself cannot build the tiny config: not our verdict).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=4, num_local_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, sliding_window=4)
PROMPTS = ((1, 2, 3, 4, 5), (7, 8, 9), (50, 3, 17, 33, 2, 61, 33))
STEPS = 3
TOL = 1e-4  # fp32 rounding of logits up to a few units
TIMEOUT_S = 300
MAX_PARAMS = 20_000_000  # the tiny fields took: a config that sizes itself otherwise
WORKERS = 2


def causal_lm_types() -> list[str]:
    """Every model_type with a causal-LM class and a config whose default carries a tp_plan."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            if getattr(CONFIG_MAPPING[model_type](), "base_model_tp_plan", None):
                types.append(model_type)
        except Exception:  # noqa: BLE001 - a config that does not build has no plan to read
            continue
    return types


def tiny_checkpoint(model_type: str, folder: Path, seed: int = 0) -> Path:
    """save_pretrained of a random tiny transformers model of ``model_type`` (the fields it
    does not know are dropped; every weight random, norms around 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cls = type(AutoConfig.for_model(model_type))
    known = set(cls().to_dict())
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items() if k in known})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name and p.dim() == 1
                    else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def world1_diff(folder: Path) -> float:
    """The largest logit difference of the generic path at world 1 from transformers."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from layer_boundary.engine.generate import greedy_generate
    from layer_boundary.models import load_model
    from layer_boundary.models.checkpoint import open_checkpoint
    from layer_boundary.runtime.args import BoundaryRuntime
    from layer_boundary.runtime.parallel import ParallelDims, build_parallel

    ours = load_model(open_checkpoint(folder, "transformers"),
                      BoundaryRuntime(build_parallel(ParallelDims())))
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    if hasattr(ref, "set_experts_implementation"):
        ref.set_experts_implementation("eager")
    gen = greedy_generate(ours, [list(p) for p in PROMPTS], STEPS)
    worst = 0.0
    with torch.no_grad():
        for j, prompt in enumerate(PROMPTS):
            out = ref(torch.tensor([prompt]), cache=DynamicCache(config=ref.config),
                      use_cache=True)
            expected = [out.logits[0, -1]]
            for token in gen.generated[j][:-1]:
                out = ref(torch.tensor([[token]]), cache=out.cache, use_cache=True)
                expected.append(out.logits[0, -1])
            for step in range(STEPS):
                worst = max(worst, (expected[step] - gen.logits[j][step]).abs().max().item())
    return worst


def tp2_diff(folder: Path) -> float:
    """The largest logit difference of the generic path at tp 2 (gloo ranks) from world 1."""
    from layer_boundary.engine.run_command import rank_entry, reference_run
    from layer_boundary.engine.runner import RunSpec, merge
    from layer_boundary.models.checkpoint import open_checkpoint
    from layer_boundary.runtime.launch import spawn

    spec = RunSpec(str(folder), checkpoint=open_checkpoint(folder, "transformers"), tp=2,
                   prompts=PROMPTS, max_new_tokens=STEPS)
    run, ref = merge(spawn(rank_entry, 2, spec, backend="gloo")), reference_run(spec)
    return max((a - b).abs().max().item() for ra, rb in zip(run.logits, ref.logits)
               for a, b in zip(ra, rb))


def one(model_type: str) -> dict:
    """The row of ``model_type`` (run in its own process)."""
    from layer_boundary.models.config import CheckpointError

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / model_type
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            known = set(type(AutoConfig.for_model(model_type))().to_dict())
            with torch.device("meta"):
                size = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                    AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items()
                                                        if k in known})).parameters())
        except Exception:  # noqa: BLE001 - no meta build: the writer below says what fails
            size = 0
        if size > MAX_PARAMS:
            return {"type": model_type, "status": "no tiny checkpoint",
                    "why": f"its config names its sizes otherwise ({size / 1e6:.0f}M "
                           "parameters with the tiny fields)"}
        try:
            tiny_checkpoint(model_type, folder)
        except Exception as exc:  # noqa: BLE001 - transformers' own failure, reported as such
            return {"type": model_type, "status": "no tiny checkpoint",
                    "why": f"{type(exc).__name__}: {exc}".splitlines()[0][:160]}
        try:
            w1 = world1_diff(folder)
        except CheckpointError as exc:
            return {"type": model_type, "status": "refused", "why": _short(str(exc))}
        try:
            tp2 = tp2_diff(folder) if w1 <= TOL else None
        except CheckpointError as exc:
            return {"type": model_type, "status": "refused", "world1": w1,
                    "why": "at tp 2: " + _short(str(exc))}
        ok = w1 <= TOL and tp2 is not None and tp2 <= TOL
        return {"type": model_type, "status": "PASS" if ok else "FAIL", "world1": w1,
                "tp2": tp2}


def _short(message: str) -> str:
    prefix = re.compile(r"^the transformers backend cannot serve model_type '[^']*': ")
    return prefix.sub("", message).splitlines()[0][:200]


def run_type(model_type: str) -> dict:
    try:
        out = subprocess.run([sys.executable, __file__, "--one", model_type],
                             capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "status": "FAIL", "why": f"no result in {TIMEOUT_S} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:160]
    return {"type": model_type, "status": "FAIL", "why": f"exit {out.returncode}: {tail}"}


def markdown(rows: list[dict]) -> str:
    import transformers

    passed = sum(r["status"] == "PASS" for r in rows)
    lines = [BEGIN, "", f"transformers {transformers.__version__}: {len(rows)} causal-LM types "
             f"with a base_model_tp_plan; {passed} PASS (world 1 = transformers and tp 2 = "
             f"world 1 within {TOL:g}, prefill and {STEPS} cached decode steps), the rest "
             "refused by name (or transformers builds no tiny model of them).", "",
             "| model_type | verdict | world 1 vs transformers | tp 2 vs world 1 | reason |",
             "|---|---|---|---|---|"]
    for r in rows:
        w1 = f"{r['world1']:.1e}" if r.get("world1") is not None else ""
        tp2 = f"{r['tp2']:.1e}" if r.get("tp2") is not None else ""
        why = r.get("why", "").replace("|", "/")
        lines.append(f"| {r['type']} | {r['status']} | {w1} | {tp2} | {why} |")
    return "\n".join(lines + ["", END])


def main(argv: list[str]) -> int:
    rows: list[dict] = []
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1])))
        return 0
    types = argv or causal_lm_types()
    # rows of an earlier, interrupted run (COVERAGE_ROWS: a file of JSON lines) are kept
    done = {}
    if os.environ.get("COVERAGE_ROWS") and Path(os.environ["COVERAGE_ROWS"]).exists():
        for line in Path(os.environ["COVERAGE_ROWS"]).read_text().splitlines():
            row = json.loads(line)
            done[row["type"]] = row
    with ThreadPoolExecutor(WORKERS) as pool:
        for row in pool.map(lambda t: done.get(t) or run_type(t), types):
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not argv:
        text = TABLE.read_text()
        start, end = text.index(BEGIN), text.index(END) + len(END)
        TABLE.write_text(text[:start] + markdown(rows) + text[end:])
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
