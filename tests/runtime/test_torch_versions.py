"""torch 2.11 to 2.15: names that moved between versions are resolved once, at import, and
nothing on a traced path calls a builtin's method through a module alias (dynamo 2.11/2.12
cannot). CI runs torch 2.13; these tests make the older torch's namespace here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layer_boundary.runtime import collectives

REPO = Path(__file__).resolve().parents[2]

# what torch 2.13 added; 2.11 and 2.12 have only the old names
NEW_NAMES = {"all_gather_single": "all_gather_into_tensor",
             "reduce_scatter_single": "reduce_scatter_tensor"}

# torch.distributed as torch 2.11 has it, in every process of the run (ranks spawned by
# ``spawn`` inherit the environment, so each imports this first); each call of an old name
# is written down, so the test sees that the fallback ran
SITECUSTOMIZE = textwrap.dedent("""
    import os
    import torch.distributed as dist

    for new, old in {names!r}.items():
        delattr(dist, new)
        call = getattr(dist, old)

        def counted(*args, _call=call, _old=old, **kwargs):
            with open(os.path.join({calls!r}, f"{{os.getpid()}}-{{_old}}"), "a") as f:
                f.write("x")
            return _call(*args, **kwargs)

        setattr(dist, old, counted)
""")


def test_the_single_tensor_names_resolve_to_torchs_own():
    """torch 2.13 here: the new names, so no call of ours meets the old names' FutureWarning."""
    import torch.distributed as dist

    for new in NEW_NAMES:
        assert hasattr(dist, new)
    assert collectives.ALL_GATHER_SINGLE == "all_gather_single"
    assert collectives.REDUCE_SCATTER_SINGLE == "reduce_scatter_single"


def _run(cache: Path, *extra, env_path: str | None = None, warnings: str = "default") -> dict:
    env = dict(os.environ, LAYER_BOUNDARY_CACHE=str(cache), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env_path, str(REPO),
                                                    env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-W", warnings, "-m", "layer_boundary",
                           "run", "--tp", "2", "--dp", "2", "--boundary-reduction", "rsv",
                           "--max-new-tokens", "3", "--json", *map(str, extra)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_a_tp2_dp2_rsv_run_without_the_new_names_matches_world1_and_the_new_names(tmp_path):
    """With ``all_gather_single`` and ``reduce_scatter_single`` gone from torch.distributed
    (torch 2.11's namespace) in every rank, the run uses the old names, matches world 1, and
    gives the same logits, bit for bit, as the run with the new names, which calls none of
    the deprecated ones (a FutureWarning is an error there, in every rank)."""
    old_torch, calls = tmp_path / "torch211", tmp_path / "calls"
    old_torch.mkdir()
    calls.mkdir()
    (old_torch / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(names=NEW_NAMES, calls=str(calls)))
    cache = tmp_path / "cache"
    old = _run(cache, "--logits-out", tmp_path / "old.safetensors", env_path=str(old_torch))
    # (torch 2.13's old names warn, being deprecated there; torch 2.11's do not)
    new = _run(cache, "--logits-out", tmp_path / "new.safetensors",
               warnings="error::FutureWarning")
    assert old["verdict"] == new["verdict"] == "PASS", (old["reason"], new["reason"])
    assert old["parity"]["tokens_match"]
    ran = {name.split("-", 1)[1] for name in os.listdir(calls)}
    assert "all_gather_into_tensor" in ran, ran  # the small sums' gathers went through it
    a, b = load_file(tmp_path / "old.safetensors"), load_file(tmp_path / "new.safetensors")
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _builtin_aliases(module) -> list[str]:
    """``module``'s globals (and its classes' attributes) that are a builtin type's method
    or slot bound to another name (``_new = object.__new__``): what dynamo 2.11/2.12 cannot
    call. A function of a module (``from math import prod``) is not one."""
    import types

    kinds = (types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodWrapperType,
             types.ClassMethodDescriptorType)
    found = []
    owners = [(module.__name__, vars(module))] + [
        (f"{module.__name__}.{name}", vars(value)) for name, value in vars(module).items()
        if isinstance(value, type) and value.__module__ == module.__name__]
    for owner, names in owners:
        for name, value in names.items():
            if name.startswith("_") and name.endswith("_"):
                continue  # a class's own slots, an enum's machinery (``_new_member_``)
            bound_to = getattr(value, "__self__", None)
            if isinstance(value, kinds) or (isinstance(value, types.BuiltinMethodType)
                                            and bound_to is not None
                                            and not isinstance(bound_to, types.ModuleType)):
                found.append(f"{owner}.{name} = {value!r}")
    return found


def test_no_module_binds_a_builtins_method_to_a_name():
    code = textwrap.dedent("""
        import importlib, json, pkgutil, sys
        import layer_boundary
        sys.path.insert(0, sys.argv[1])
        from test_torch_versions import _builtin_aliases
        found = []
        for info in pkgutil.walk_packages(layer_boundary.__path__, "layer_boundary."):
            if not info.name.endswith(".__main__"):  # the command line itself
                found += _builtin_aliases(importlib.import_module(info.name))
        print(json.dumps(found))
    """)
    # its own process: importing every module (the Triton kernels, the engine) here would
    # change what later tests see imported
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_the_alias_check_sees_one():
    import types

    module = types.ModuleType("example")
    module._new = object.__new__
    module._join = str.join
    module.prod = __import__("math").prod
    assert len(_builtin_aliases(module)) == 2
