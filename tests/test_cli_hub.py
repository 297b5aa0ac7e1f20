"""``--model`` takes a Hugging Face repo id: resolved from the hub's cache, laid out as the
hub lays it out (``models--ORG--NAME/snapshots/<commit>/`` and ``refs/main``), without a
download when ``HF_HUB_OFFLINE`` is set; a repo id in no cache is a one-line error."""

from __future__ import annotations

import json
import shutil

from distributed.checks import cli_ok

from layer_boundary.engine.cli import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, checkpoint, repo="tiny-org/tiny-qwen3"):
    org, name = repo.split("/")
    snapshot = root / f"models--{org}--{name}" / "snapshots" / COMMIT
    shutil.copytree(checkpoint, snapshot)
    (root / f"models--{org}--{name}" / "refs").mkdir()
    (root / f"models--{org}--{name}" / "refs" / "main").write_text(COMMIT)
    return repo


def test_a_repo_id_runs_from_the_hub_cache(qwen3_dir, tmp_path, monkeypatch, capsys,
                                           restore_logger):
    repo = hub_cache(tmp_path / "hub", qwen3_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = json.loads(cli_ok(["run", "--model", repo, "--tp", "1", "--dp", "1", "--json",
                                "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                               capsys).strip().splitlines()[-1])
    direct = json.loads(cli_ok(["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1",
                                "--json", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
                               capsys).strip().splitlines()[-1])
    assert report["prompts"] == direct["prompts"]


def test_a_repo_id_in_no_cache_is_a_one_line_error(tmp_path, monkeypatch, capsys,
                                                   restore_logger):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "tiny-org/absent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: --model tiny-org/absent: no such folder, and the repo id is not "
        "in the Hugging Face cache (HF_HUB_OFFLINE is set, so nothing is downloaded)"]


def test_an_adapter_repo_id_runs_from_the_hub_cache(qwen3_dir, tmp_path, monkeypatch, capsys,
                                                    restore_logger):
    """``--lora NAME=ORG/REPO`` resolves as ``--model`` does: the adapter from the cache gives
    the same numbers as its folder; one in no cache is a one-line error naming the flag."""
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32)
    folder = tmp_path / "adapter"
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                              init_lora_weights=False)).save_pretrained(folder)
    repo = hub_cache(tmp_path / "hub", folder, repo="tiny-org/tiny-lora")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    common = ["run", "--model", str(qwen3_dir), "--tp", "1", "--dp", "1", "--json",
              "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--prompt-lora", "x"]
    runs = {}
    for name, extra in (("hub", ["--lora", f"x={repo}"]), ("local", ["--lora", f"x={folder}"]),
                        ("plain", [])):
        args = [*common, *extra, "--logits-out", str(tmp_path / f"{name}.safetensors")]
        if not extra:
            args.remove("--prompt-lora")
            args.remove("x")
        json.loads(cli_ok(args, capsys).strip().splitlines()[-1])
        runs[name] = load_file(str(tmp_path / f"{name}.safetensors"))
    assert runs["hub"].keys() == runs["local"].keys()
    assert all(torch.equal(runs["hub"][k], runs["local"][k]) for k in runs["hub"])
    assert not all(torch.equal(runs["plain"][k], runs["local"][k]) for k in runs["hub"])
    assert main(["run", "--model", str(qwen3_dir), "--lora", "x=tiny-org/absent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "layer-boundary: error: --lora x=tiny-org/absent: no such folder, and the repo id is "
        "not in the Hugging Face cache (HF_HUB_OFFLINE is set, so nothing is downloaded)"]
