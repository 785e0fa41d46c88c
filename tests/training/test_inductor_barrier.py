"""training/compile/inductor_barrier.py: the source rewrite (a barrier before each load of a pointer the kernel
stored earlier, nothing else changed) and the hook on inductor's Triton compile call. CPU-only: the
rewrite is text; the GPU effect is tests/training/test_inductor_barrier_gpu.py's."""
from __future__ import annotations

import textwrap

from training.compile import inductor_barrier
from training.compile.inductor_barrier import BARRIER, add_reload_barriers

# The shape of the kernel that races (training/compile/inductor_barrier.py): a loop stores the normalised row,
# a later loop loads it back; other loads and a store-only pointer are left alone.
KERNEL = textwrap.dedent('''\
    def triton_red_fused_layer_norm_1(in_ptr0, in_ptr1, out_ptr2, out_ptr3, xnumel, r0_numel):
        for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
            tmp0 = tl.load(in_ptr0 + (r0_2 + 256*x3), r0_mask & xmask)
            tl.store(out_ptr2 + (r0_2 + 256*x3), tmp0, r0_mask & xmask)
        tl.store(out_ptr3 + (x3), tmp7, xmask)
        for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
            tmp8 = tl.load(out_ptr2 + (r0_2 + 256*x3), r0_mask & xmask, other=0.0)
            tmp9 = tl.load(in_ptr1 + (r0_2), r0_mask, other=0.0)
            tl.store(out_ptr2 + (r0_2 + 256*x3), tmp8 * tmp9, r0_mask & xmask)
    ''')


def test_a_barrier_goes_before_each_read_back_only():
    out, added = add_reload_barriers(KERNEL)
    assert added == 1
    lines = out.split("\n")
    i = next(n for n, line in enumerate(lines) if "tl.load(out_ptr2" in line)
    assert lines[i - 1] == "        " + BARRIER  # same indentation as the load, inside its loop
    assert out.replace("        " + BARRIER + "\n", "") == KERNEL  # nothing else changed
    assert sum(BARRIER in line for line in lines) == 1


def test_sources_without_a_read_back_are_returned_unchanged():
    no_reload = KERNEL.replace("tl.load(out_ptr2", "tl.load(in_ptr0")
    assert add_reload_barriers(no_reload) == (no_reload, 0)
    # a load before the pointer's first store is not a read-back
    first_load = "tmp = tl.load(out_ptr0 + (x0), xmask)\ntl.store(out_ptr0 + (x0), tmp, xmask)"
    assert add_reload_barriers(first_load) == (first_load, 0)


def test_rewriting_twice_adds_nothing():
    once, _ = add_reload_barriers(KERNEL)
    assert add_reload_barriers(once) == (once, 0)


def test_install_routes_inductor_triton_sources_through_the_rewrite(monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    seen = []
    monkeypatch.setattr(AsyncCompile, "triton", lambda self, name, source, *a, **k: seen.append((name, source)))
    monkeypatch.setattr(inductor_barrier, "_installed", False)
    assert inductor_barrier.install() and inductor_barrier.install()  # idempotent
    AsyncCompile.triton(None, "k1", KERNEL, device_str="cuda")
    AsyncCompile.triton(None, "k2", "tl.store(out_ptr0 + (x0), v, None)")
    assert seen[0] == ("k1", add_reload_barriers(KERNEL)[0])
    assert seen[1] == ("k2", "tl.store(out_ptr0 + (x0), v, None)")
