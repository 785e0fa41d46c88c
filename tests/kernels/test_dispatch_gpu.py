"""The Hopper dispatch table (csrc/hopper/dispatch.cu) seen from Python: which kernels each named path
of tests/gpu_util.py launches (by name, in the profiler), what set_sm90_choice accepts, that the
backward's schedules agree bit for bit, and that the NaN poison test_kernels_gpu.py relies on reaches
every allocation our kernels write into."""
import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:Deterministic behavior was enabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*does not have a deterministic implementation:UserWarning")]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels  # noqa: E402
from kernels import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from gpu_util import (TABLE_ENTRIES, InputSeeds, ext, forward_key_tile, kernel_families,  # noqa: E402
                      kernel_path as run_path, launched_kernels, poison_uninitialised_memory, reset_dispatch)

_seed = InputSeeds(4321)


@pytest.fixture(scope="module", autouse=True)
def _ext():
    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())


# --- the NaN poison ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_uninitialised_memory_is_poisoned(dtype):
    """The module's poison reaches every way our outputs are allocated: at::empty behind the dispatcher
    (the binding; aten::empty.memory_format, also what torch.empty calls), new_empty and empty_like
    (kernels/flash_attn.py), on memory the caching allocator hands out again. Without it an output
    element a kernel leaves unwritten would pass unnoticed."""
    with poison_uninitialised_memory():
        _check_poison(dtype)


def _check_poison(dtype):
    dirty = torch.ones(1 << 20, device="cuda", dtype=dtype)
    del dirty  # freed to the caching allocator: the next tensors reuse its ones
    like = torch.ones(300, 7, device="cuda", dtype=dtype)
    tensors = {"at::empty": torch.ops.aten.empty.memory_format([300, 7], dtype=dtype, device="cuda"),
               "torch.empty": torch.empty(300, 7, device="cuda", dtype=dtype),
               "new_empty": like.new_empty((300, 7)), "empty_like": torch.empty_like(like)}
    for how, t in tensors.items():
        assert torch.isnan(t).all(), f"{how}: uninitialised memory is not NaN; the kernels' poison is off"


# --- the Hopper dispatch table (csrc/hopper/dispatch.cu; tests/gpu_util.py KERNEL_PATHS) -------------
hopper_only = pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9,
                                 reason="one kernel family off Hopper: nothing to dispatch")


def _families(sq, d, causal, h=4):
    """kernel_families of one forward and backward of batch 2, sq queries and keys, h heads."""
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = flash_attn_func(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    return kernel_families(launched_kernels(fwd_bwd))


def _expected(name, sq, d, causal):
    """The kernel families path `name` launches at sq queries and keys (head dims 64 / 128): by default
    the backward in turns from 1024 queries, at head dim 128 without a causal mask from 512."""
    default_bwd = "hopper_bwd_turns" if sq >= (512 if d == 128 and not causal else 1024) else "hopper_bwd_lockstep"
    return {"default": {"hopper_fwd", default_bwd}, "hopper": {"hopper_fwd", default_bwd},
            "fa2": {"fa2_fwd", "fa2_bwd"}, "fa2_bwd": {"hopper_fwd", "fa2_bwd"},
            "lockstep": {"hopper_fwd", "hopper_bwd_lockstep"}, "turns": {"hopper_fwd", "hopper_bwd_turns"}}[name]


@hopper_only
@pytest.mark.parametrize("name", ["default", "fa2", "fa2_bwd", "hopper", "lockstep", "turns"])
@pytest.mark.parametrize("sq", [384, 512, 2048])  # buckets 0 (<= 1k keys) and 1; around the turns' thresholds
@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (128, False)])
def test_each_path_launches_its_kernels(name, sq, d, causal):
    """Each named path runs its kernels, seen by name in the profiler: the default the Hopper forward
    and backward, the backward in lock-step at 384 queries, at 512 too but at head dim 128 without a
    causal mask, and in turns at 2048; choice 0 the FA2 kernels; backward choice 2 the lock-step and 3
    the turns kernel in both buckets."""
    with run_path(name):
        found = _families(sq, d, causal)
    assert found == _expected(name, sq, d, causal), f"path {name}: launched {sorted(found)}"


@hopper_only
@pytest.mark.parametrize("sk,keys", [(1024, 128), (2047, 128), (2048, 160), (3001, 160)])
def test_forward_key_tiles(sk, keys):
    """The head-dim-128 forward without a causal mask runs 160-key tiles from 2048 keys, 128 below
    (csrc/hopper/dispatch.h wide_key_tiles)."""
    torch.manual_seed(next(_seed))
    q = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    names = [n for n in launched_kernels(lambda: flash_attn_func(q, k, v)) if "flash_fwd_sm90_ws_kernel" in n]
    assert len(names) == 1 and forward_key_tile(names[0]) == keys, names


@hopper_only
@pytest.mark.parametrize("d,causal,varlen", [(128, True, True), (128, False, False), (64, False, False)])
def test_default_runs_the_warp_specialised_kernels(d, causal, varlen):
    """The default Hopper forward and backward are the TMA kernels, not a silent fallback to FA2, on
    lengths that are not multiples of the tiles and on packed sequences (the longest, 1400, decides the
    backward's schedule: turns)."""
    torch.manual_seed(next(_seed))
    sq, h = 2100, 3  # not multiples of the tiles
    shape = (sq, h, d) if varlen else (2, sq, h, d)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 700, 2100], device="cuda", dtype=torch.int32)

    def fwd_bwd():
        if varlen:
            out = flash_attn_varlen_func(q, k, v, cu, cu, 1400, 1400, causal=causal, deterministic=True)
        else:
            out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        torch.autograd.grad(out, (q, k, v), dout)

    names = launched_kernels(fwd_bwd)
    assert kernel_families(names) == {"hopper_fwd", "hopper_bwd_turns"}, names


@hopper_only
def test_a_choice_sets_only_its_class():
    """set_sm90_choice changes the kernels of its (pass, head dim, causal, bucket) only: the causal
    class's backward forced to lock-step and its forward to FA2 at 2048 keys leave the non-causal class
    and the 512-key bucket on the defaults."""
    e = ext()
    bucket = e.seqlen_bucket(2048)
    assert bucket == 1 and e.seqlen_bucket(512) == 0
    try:
        e.set_sm90_choice(1, 128, True, bucket, 2)
        e.set_sm90_choice(0, 128, True, bucket, 0)
        assert e.sm90_choice(1, 128, True, bucket) == 2 and e.sm90_choice(0, 128, True, bucket) == 0
        assert _families(2048, 128, True) == {"fa2_fwd", "hopper_bwd_lockstep"}
        assert _families(2048, 128, False) == {"hopper_fwd", "hopper_bwd_turns"}
        assert _families(1500, 128, True, h=2) == {"fa2_fwd", "hopper_bwd_lockstep"}  # the same bucket
        assert _families(512, 128, True) == {"hopper_fwd", "hopper_bwd_lockstep"}
    finally:
        reset_dispatch()


@pytest.mark.parametrize("bucket", [0, 1, 2, 3])
def test_backward_schedules_are_choices_in_every_bucket(bucket):
    """The backward's choices 2 (lock-step) and 3 (turns) are accepted in every seqlen bucket, <= 1k
    keys included, and read back; -1 restores the default."""
    e = ext()
    try:
        for d, causal, choice in itertools.product((64, 128), (False, True), (2, 3, -1)):
            e.set_sm90_choice(1, d, causal, bucket, choice)
            assert e.sm90_choice(1, d, causal, bucket) == choice
    finally:
        reset_dispatch()


@pytest.mark.parametrize("entry", [
    (0, 128, True, 1, 2), (0, 64, False, 0, 3),  # the forward has no schedules
    (1, 128, True, 0, 4), (1, 64, False, 3, -2), (0, 128, False, 2, 5),  # no such choice
    (0, 96, True, 0, 1), (1, 128, True, 4, 0), (2, 128, True, 0, 0),  # no such head dim, bucket, pass
])
def test_out_of_range_entries_raise(entry):
    """A choice, head dim, bucket or pass outside the table raises ValueError and changes no entry."""
    e = ext()
    try:
        with pytest.raises(ValueError):
            e.set_sm90_choice(*entry)
        assert all(e.sm90_choice(*cls) == -1 for cls in TABLE_ENTRIES)
    finally:
        reset_dispatch()


@hopper_only
@pytest.mark.parametrize("sq", [700, 1100])  # the default backward in lock-step / in turns
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_backward_schedule_changes_no_result(sq, d, causal):
    """The Hopper backward with its warpgroups in lock-step and in turns (dQ one step late), forced or
    by default, gives the same forward and deterministic backward bit for bit. Batch 2 x 5 heads."""
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, sq, 5, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    default = fwd_bwd()
    for name in ("lockstep", "turns", "hopper"):
        with run_path(name):
            for what, a, b in zip(("out", "dq", "dk", "dv"), default, fwd_bwd()):
                assert torch.equal(a, b), (name, what)
