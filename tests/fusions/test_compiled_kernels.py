"""The Triton launches under ``torch.compile`` (``runtime.kernel_ops``): each kernel wrapper of
the Triton provider and of the in-place decode attention is a ``layer_boundary::`` custom op
while dynamo traces, its fake and its declared writes checked by ``torch.library.opcheck``;
a Qwen3 with the Triton provider (which decodes in place) compiles whole (fullgraph: under the
interpreter a kernel dynamo traced into would fail) on tp-2 ranks, its padded prefill and
decode steps reading the keys and values its compiled steps wrote, and matches eager world 1
(on a GPU the same graph is what ``run --device cuda`` captures)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from layer_boundary.fusions import kernels  # noqa: E402 - after the interpreter is chosen
from layer_boundary.models import decode_kernel  # noqa: E402


def _cache(dtype=torch.float32, dv=16):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(3, 2, 8, 16, generator=gen).to(dtype),
            torch.randn(3, 2, 8, dv, generator=gen).to(dtype))


def _cases():
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    k_cache, v_cache = _cache()
    slots, rows = torch.tensor([2, 0]), torch.tensor([5, 1])
    return {
        "add_rms_norm": (kernels.add_rms_norm, (rand(3, 48), rand(3, 48), rand(48), 1e-6)),
        "add_rms_norm zero-centered": (kernels.add_rms_norm,
                                       (rand(3, 48), rand(3, 48), rand(48), 1e-6, True)),
        "add_rms_norm_fp8": (kernels.add_rms_norm_fp8,
                             (rand(3, 64), rand(3, 64), rand(64), 1e-6, 16)),
        "head_norm_rope": (kernels.head_norm_rope,
                           (rand(3, 4, 16), rand(16), 1e-6, rand(3, 16), rand(3, 16))),
        "silu_mul": (kernels.silu_mul, (rand(3, 40), rand(3, 40))),
        "decode_attention": (decode_kernel.decode_attention,
                             (rand(2, 4, 16), k_cache, v_cache, slots, rows + 1, 0.25)),
        "decode_attention ring, sinks, softcap": (
            decode_kernel.decode_attention,
            (rand(2, 4, 16), k_cache, v_cache, slots, torch.tensor([13, 3]), 0.25, 6, True,
             rand(4), 2.5)),
        "store_kv": (decode_kernel.store_kv,
                     (k_cache, v_cache, slots, rows, rand(2, 2, 16), rand(2, 2, 16))),
        "store_kv, keys are values": (decode_kernel.store_kv, (k_cache, None, slots, rows,
                                                               rand(2, 2, 16), rand(2, 2, 16))),
    }


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_each_launch_is_a_custom_op_that_opcheck_accepts(name):
    """The fake's shapes and dtypes are the launch's, and the schema names every tensor it
    writes (a cache the launch stores into), as a compiled graph relies on."""
    wrapper, args = CASES[name]
    torch.library.opcheck(wrapper.op, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_a_keys_view_as_values_is_written_through_the_op():
    """MLA's values are a view of its keys' first dims: both arguments alias one cache, and
    the compiled write leaves it as the eager write does."""
    k = torch.randn(2, 1, 8)
    v = torch.randn(2, 1, 8)

    def write(cache):
        decode_kernel.store_kv(cache, cache[..., :4], torch.tensor([1, 0]),
                               torch.tensor([3, 2]), k, v[..., :4])
        return cache.sum()

    eager, compiled = torch.zeros(2, 1, 6, 8), torch.zeros(2, 1, 6, 8)
    write(eager)
    torch.compile(write, fullgraph=True, backend="aot_eager")(compiled)
    assert torch.equal(compiled, eager) and eager.abs().sum() > 0


def test_a_compiled_tp2_run_with_the_triton_provider_matches_world1(qwen3_dir):
    """``run --fusions triton --compile`` on the CPU was refused (dynamo could not trace the
    interpreter): the ranks now compile the kernels' ops, match eager world 1 run without a
    provider, and completed every stage input after the stack's entry fused."""
    from dataclasses import replace

    from distributed.checks import assert_logits_match
    from distributed.pool import get_pool

    from layer_boundary.engine.runner import RunSpec, merge, run_rank

    prompts = ((3, 1, 4, 1, 5), (9, 2), (6, 5, 3))
    spec = RunSpec(str(qwen3_dir), tp=2, boundary_reduction="ar", prompts=prompts,
                   max_new_tokens=2, fusions="triton", compile="aot_eager")
    results = get_pool(2).run(run_rank, spec)
    world1 = merge([run_rank(replace(spec, tp=1, fusions=None, compile=None), world_size=1)])
    assert_logits_match(merge(results), world1, len(prompts))
    layers = len(results[0].layers)
    inputs = [f"layer{i}.{s}" for i in range(layers) for s in ("attn", "ffn")][1:]
    assert all(r.fused_stages == inputs and r.compiled_graphs > 0 for r in results), [
        (r.fused_stages, r.compiled_graphs) for r in results]
