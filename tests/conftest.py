import os
import sys
from pathlib import Path

import pytest

# tests/ on the path whatever pytest's import mode (its default prepends it, importlib mode
# does not), so the checkpoints package and the test modules import; the rank workers get this
# sys.path too (distributed/pool.py), to unpickle the test functions they run
sys.path.insert(0, str(Path(__file__).parent))
# examples/ (the GPT-2 outside model, the engine loop): importable here and in rank workers
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
os.environ.setdefault("LAYER_BOUNDARY_CACHE", str(Path(__file__).parent.parent / ".cache"))
# the suite's tensors are on the CPU, so the Triton provider's kernels run under the
# interpreter; it is chosen before anything imports triton (torch's compiler does, and the
# fork server that rank workers come from imports the engine), here and in every rank
# worker, which inherits the environment (scripts/gpu_check.sh compiles them for real)
os.environ.setdefault("TRITON_INTERPRET", "1")
# every multi-rank case runs with the agreement check (runtime/agreement.py): ranks that decide
# differently end with an error naming the decision, never a silent pass (rank workers
# inherit the environment, and read it at import)
os.environ.setdefault("LAYER_BOUNDARY_CHECK_AGREEMENT", "1")
# and every run_rank audits its sums: a contribution summed other than once raises
# (engine/audit.py), whatever the numbers
os.environ.setdefault("LAYER_BOUNDARY_STRICT_AUDIT", "1")

from checkpoints import hf_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    """The default tiny checkpoint the multi-rank tests share (untied, rope_theta 1e4)."""
    return hf_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen3_tied_dir(tmp_path_factory) -> Path:
    return hf_qwen3(tmp_path_factory.mktemp("qwen3_tied"), seed=1, tie=True, rope_theta=1e6)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (dense layer 0, then 8-expert top-2 layers) the MoE tests share."""
    from checkpoints import hf_qwen3_moe

    return hf_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture
def restore_logger():
    """main() points the package logger at the current stdout; later tests must not inherit it."""
    from distributed.checks import package_logger_kept

    with package_logger_kept():
        yield


# Test tiers (pytest -m): each test is marked by what it runs, so a developer can run a fast
# tier (``scripts/test.sh -m "not slow and not models"``: the toy stacks on every row mode,
# on rank pools too); the suite runs them all.
TIERS = {
    "distributed": "runs cases on a pool of gloo rank processes (tests/distributed/pool.py)",
    "models": "builds reference models from checkpoints (the engine's runs, model files)",
    "oracle": "compares with transformers or peft",
    "slow": "compiles (torch.compile) or starts a command or a script in its own processes",
}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def _tiers(item) -> set:
    module, name = item.module, item.name
    path = Path(str(item.fspath))
    tiers = set()
    if hasattr(module, "get_pool") or path.parent.name == "distributed":
        tiers.add("distributed")
    if (path.parent.name in ("distributed", "models", "examples")
            or any(hasattr(module, name) for name in ("RunSpec", "run_rank", "load_model"))):
        tiers.add("models")
    if path.stem.endswith("_oracle") or "transformers" in name or "peft" in name or any(
            hasattr(module, helper) for helper in ("hf_oracle", "hf_reference",
                                                   "transformers_prefill")):
        tiers.add("oracle")
    if ("compile" in path.stem or "compile" in name or hasattr(module, "subprocess")
            or hasattr(module, "cli_ok") or path.parent.name == "examples"):
        tiers.add("slow")
    return tiers


def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in _tiers(item):
            item.add_marker(tier)
