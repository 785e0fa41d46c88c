"""GPU checks of local (sliding-window) attention, window_size=(left, right), in our kernels.

Against the fp32 reference (kernels.reference, window_mask's semantics) with the tolerance of
test_kernels_gpu.py: the kernel's max abs error <= 2 x PyTorch's own error computing the same thing in
bf16/fp16 + a small eps + the reference's own rounding to that dtype, for the output and dq, dk, dv; the
LSE where the reference's is finite, +inf and a zero output where a row sees no key. Uninitialised memory
is poisoned with NaN (an element a kernel leaves unwritten shows). On sm_90 windowed calls at head dims 64
/ 128 run the Hopper (TMA) kernels as unwindowed ones do (docs/kernels.md, dispatch); the correctness
tests run on the default path and, on Hopper, also on FA2 in both passes, on the Hopper forward with the
FA2 backward, and on the Hopper backward taking turns (the `path` fixture).
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:Deterministic behavior was enabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*does not have a deterministic implementation:UserWarning")]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func  # noqa: E402
from kernels.reference import attention_ref, attention_varlen_ref  # noqa: E402
from gpu_util import (InputSeeds, backward_path_fixture, built_and_poisoned,  # noqa: E402,F401
                      check_against_torch, is_hopper, kernel_families, kernel_path, launched_kernels,
                      skip_same_kernel)

# The kernel paths the correctness tests run on: the default (on sm_90 the Hopper kernels, the backward in
# lock-step below 1024 queries, or 512 at head dim 128 without a causal mask, in turns from there) and, on
# Hopper only, FA2 in both passes, the FA2 backward after the Hopper forward (its out / LSE), and the Hopper
# backward in turns at every length.
path = backward_path_fixture(("default", "fa2", "fa2_bwd", "turns"))

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 96, 128]
WINDOWS = [(0, 0), (1, 0), (127, 0), (256, 256), (-1, 64), (512, -1)]
EPS_OUT, EPS_GRAD = 1e-4, 1e-3
_seed = InputSeeds(4321)


def _check_lse(lse, lse_ref, out, rows_dim):
    """lse equal to the reference's where finite; +inf (ours) where the reference has -inf, with a zero
    output row there. rows_dim: out's query-row dim (out's next dim is the heads; lse ends (heads, rows))."""
    finite = torch.isfinite(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < 1e-2
    assert torch.isposinf(lse[~finite]).all()
    assert (out.transpose(rows_dim, rows_dim + 1)[~finite] == 0).all()


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def run_dense(b, h, hk, sq, sk, d, dtype, causal, window, deterministic=False, seed=None):
    torch.manual_seed(next(_seed) if seed is None else seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)

    out, lse = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, return_lse=True,
                               window_size=window)
    grads = _grads(out, (q, k, v), dout)

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_ref(qf, kf, vf, causal, window_size=window)
    grads_ref = _grads(out_ref, (qf, kf, vf), dout.float())
    out_pt, _ = attention_ref(q, k, v, causal, upcast=False, window_size=window)
    grads_pt = _grads(out_pt, (q, k, v), dout)

    check_against_torch("out", out, out_ref, out_pt, EPS_OUT)
    _check_lse(lse, lse_ref, out, 1)
    for n, a, r, p in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        check_against_torch(n, a, r, p, EPS_GRAD)
    return q, k, v, dout, out, grads


# (batch, heads, kv heads, seqlen_q, seqlen_k): odd sizes both ways, one tile-aligned.
SHAPES = [(1, 2, 2, 1000, 1037), (2, 2, 2, 1037, 1000), (1, 2, 2, 512, 512)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_window_dense(shape, dtype, d, window, causal, path):
    skip_same_kernel(d, path)
    run_dense(*shape, d, dtype, causal, window)


def test_window_dv_rounding_case():
    """An input (seed 4392) where torch's bf16 dV error (1.05e-2) fell below the rounding of dV's largest
    elements (near 6: half a ulp is 1.6e-2), so ours (2.2e-2, the same as an exact emulation of the
    kernel's arithmetic) exceeded 2x torch's: the tolerance counts the reference's own rounding."""
    run_dense(1, 2, 2, 512, 512, 64, torch.bfloat16, True, (256, 256), seed=4392)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (127, 0), (-1, 64), (40, 3)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_window_rows_that_see_no_key(d, window, causal, path):
    """seqlen_q > seqlen_k: the bands of the first rows lie left of key 0 (offset sk - sq = -550), so those
    rows see no key: output 0, LSE +inf."""
    run_dense(2, 2, 2, 700, 150, d, torch.bfloat16, causal, window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (127, 0), (300, 5), (-1, 64)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_window_many_tiles_per_cta(d, window, causal, path):
    """More query tiles than an H100 has SMs (3 x 16 heads x 9 / 6 blocks), seqlen_q > seqlen_k and the
    reverse in turn: the persistent Hopper forward walks several tiles per CTA, some with no key at all
    (empty blocks between full ones), its K/V ring and Q buffers running on from tile to tile."""
    run_dense(3, 16, 16, 1100, 700, d, torch.bfloat16, causal, window)
    run_dense(3, 16, 4, 1037, 2100, d, torch.bfloat16, causal, window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_window_gqa(d, window, causal, path):
    run_dense(2, 8, 2, 700, 900, d, torch.bfloat16, causal, window)


def _cu(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_varlen(dtype, d, window, causal, path):
    """Uneven documents (1 to 1000 tokens, seqlen_q != seqlen_k in some), GQA 4:2: the window applies
    inside each document."""
    skip_same_kernel(d, path)
    torch.manual_seed(next(_seed))
    lens_q, lens_k = [1, 17, 129, 300, 64, 1000], [5, 17, 100, 300, 200, 1000]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    h, hk = 4, 2
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      return_lse=True, window_size=window)
    grads = _grads(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_varlen_ref(qf, kf, vf, cu_q, cu_k, causal, window_size=window)
    grads_ref = _grads(out_ref, (qf, kf, vf), dout.float())
    out_pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal, upcast=False, window_size=window)
    grads_pt = _grads(out_pt, (q, k, v), dout)
    check_against_torch("out", out, out_ref, out_pt, EPS_OUT)
    _check_lse(lse, lse_ref, out, 0)
    for n, a, r, p in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        check_against_torch(n, a, r, p, EPS_GRAD)


@pytest.mark.parametrize("name", ["default", "lockstep", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (127, 0), (256, 256), (-1, 64), (512, -1)], ids=str)
@pytest.mark.parametrize("d", HDIMS)
def test_window_deterministic_backward(d, window, causal, name):
    """The deterministic backward orders each query block's dQ additions over only the key blocks that
    visit it (BwdRange::dq_order, in the FA2 and the Hopper backward): it must neither hang nor vary.
    Paths: the default (Hopper: in turns at 1300 queries), lock-step and FA2 (the last two on Hopper only)."""
    if name != "default" and not is_hopper():
        pytest.skip("one kernel family off Hopper")
    with kernel_path(name):
        q, k, v, dout, _, g1 = run_dense(2, 4, 2, 1300, 1400, d, torch.bfloat16, causal, window, deterministic=True)
        for _ in range(2):
            out = flash_attn_func(q, k, v, causal=causal, deterministic=True, window_size=window)
            for a, b_ in zip(g1, _grads(out, (q, k, v), dout)):
                assert torch.equal(a, b_)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_window_kernel_families(d, causal):
    """Which kernels a windowed call launches: on sm_90 at head dims 64 / 128 those of the path (300
    queries: the default backward in lock-step); FA2 throughout at head dim 96 and off Hopper."""
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def step():
        out = flash_attn_func(q, k, v, causal=causal, window_size=(63, 0 if causal else 17))
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    expected = {"default": {"hopper_fwd", "hopper_bwd_lockstep"}, "hopper": {"hopper_fwd", "hopper_bwd_lockstep"},
                "turns": {"hopper_fwd", "hopper_bwd_turns"}, "fa2_bwd": {"hopper_fwd", "fa2_bwd"},
                "fa2": {"fa2_fwd", "fa2_bwd"}}
    for name in expected if is_hopper() else ("default",):
        with kernel_path(name):
            found = kernel_families(launched_kernels(step))
        want = expected[name] if is_hopper() and d != 96 else {"fa2_fwd", "fa2_bwd"}
        assert found == want, f"path {name}: launched {sorted(found)}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_window_that_bounds_nothing_is_the_dense_kernel(d, causal):
    """(-1, -1), windows at least as long as the sequences, and causal with right >= 0 give the unwindowed
    call's bits (the binding maps them to no window: the same kernel runs)."""
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, 333, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dense = flash_attn_func(q, k, v, causal=causal)
    for window in [(-1, -1), (333, 333), (5000, -1), (-1, 400)] + ([(-1, 0), (-1, 7)] if causal else []):
        assert torch.equal(flash_attn_func(q, k, v, causal=causal, window_size=window), dense), window


def test_causal_window_right_unbounded_equals_right_zero():
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(1, 500, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a = flash_attn_func(q, k, v, causal=True, window_size=(100, -1))
    b = flash_attn_func(q, k, v, causal=True, window_size=(100, 0))
    assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 128])
def test_window_qkvpacked_matches_the_slices(d):
    torch.manual_seed(next(_seed))
    h, hk = 6, 2
    qkv = torch.randn(2, 700, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(2, 700, h, d, device="cuda", dtype=torch.bfloat16)
    out_p = flash_attn_qkvpacked_func(qkv, n_kv_heads=hk, causal=True, deterministic=True, window_size=(99, 0))
    (g_p,) = torch.autograd.grad(out_p, qkv, dout)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]
    out_s = flash_attn_func(q, k, v, causal=True, deterministic=True, window_size=(99, 0))
    (g_s,) = torch.autograd.grad(out_s, qkv, dout)
    assert torch.equal(out_p, out_s) and torch.equal(g_p, g_s)


def _ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def test_window_work_scales_with_the_window():
    """A 256-token causal window over 64k tokens visits ~1/128 of the causal key tiles: forward and
    forward + backward each take well under a quarter of the dense causal time (each path's kernels in
    both, to compare like with like; a kernel that masked instead of skipping tiles would take about as
    long). Long and with 2 heads so that the work linear in the tokens (the backward's dq accumulator,
    its pre- and post-processing, launches: ~0.8 ms f+b at 16k x 8 heads) stays small beside the dense
    time, which grows with the square. On Hopper also the default path (the Hopper kernels)."""
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(1, 65536, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def fwd(window):
        return lambda: flash_attn_func(q, k, v, causal=True, window_size=window)

    def fwd_bwd(window):
        return lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True, window_size=window), (q, k, v), dout)

    for name in ("fa2", "default") if is_hopper() else ("fa2",):
        with kernel_path(name):
            for make in (fwd, fwd_bwd):
                dense, local = _ms(make((-1, -1))), _ms(make((255, 0)))
                assert local < 0.25 * dense, \
                    f"path {name}, {make.__name__}: windowed {local:.2f} ms vs dense {dense:.2f} ms"
