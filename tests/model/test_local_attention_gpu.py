"""A local layer (model.attention_window) on CUDA in bf16 for flash (our kernel's window_size: the packed-qkv,
separate q/k/v and packed-document entry points), sdpa and math, against the fp32 windowed reference: each
within 2x PyTorch's own bf16 error, forward and backward. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import check_against_torch  # noqa: E402
from kernels.reference import attention_ref, attention_varlen_ref  # noqa: E402
from model.attention import CausalSelfAttention  # noqa: E402
from model.config import GPTConfig  # noqa: E402

EPS_OUT, EPS_GRAD = 1e-4, 1e-3


def _cfg(h, hk, d, t, w, backend):
    return GPTConfig(d_model=h * d, n_head=h, n_kv_head=hk, seq_len=t, attention=backend, attention_window=w)


@pytest.mark.parametrize("backend", ["flash", "sdpa", "math"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("b,t,h,hk,d,w", [(2, 1024, 4, 4, 128, 256), (1, 777, 8, 2, 64, 100), (3, 129, 2, 1, 128, 1)])
def test_local_layer_bf16_against_the_fp32_reference(backend, packed, b, t, h, hk, d, w):
    attn = CausalSelfAttention(_cfg(h, hk, d, t, w, backend), backend, window=w)
    torch.manual_seed(t + d + w)
    q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, t, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)
    if packed:  # documents over the flattened batch; every row starts one (as data/loader.py's segments)
        bounds = sorted({r * t for r in range(b)} | {r * t + t // 3 for r in range(b)} | {b * t - 7}) + [b * t]
        cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
        maxlen = max(y - x for x, y in zip(bounds, bounds[1:]))

        def ref_fn(q_, k_, v_, up):
            o, _ = attention_varlen_ref(q_.flatten(0, 1), k_.flatten(0, 1), v_.flatten(0, 1), cu, cu, causal=True,
                                        upcast=up, window_size=(w - 1, 0))
            return o.view(b, t, h, d)
    else:
        cu, maxlen = None, None

        def ref_fn(q_, k_, v_, up):
            return attention_ref(q_, k_, v_, causal=True, upcast=up, window_size=(w - 1, 0))[0]
    out = attn._local(q, k, v, cu, maxlen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = ref_fn(qf, kf, vf, True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    pt = ref_fn(q, k, v, False)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for name, ours, r, p, eps in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (pt, *pt_grads),
                                     (EPS_OUT, EPS_GRAD, EPS_GRAD, EPS_GRAD)):
        check_against_torch(f"{backend} packed={packed} w={w} {name}", ours, r, p, eps)


def test_flash_packed_qkv_module_matches_reference_module():
    """The module's packed-qkv entry point (flash, learned positions, no documents) with a window."""
    h, hk, d, t, w = 4, 2, 64, 512, 128
    torch.manual_seed(0)
    flash = CausalSelfAttention(_cfg(h, hk, d, t, w, "flash"), "flash", window=w).cuda()
    ref = CausalSelfAttention(_cfg(h, hk, d, t, w, "reference"), "reference", window=w).cuda()
    ref.load_state_dict(flash.state_dict())
    x = torch.randn(2, t, h * d, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        got = flash(x)
        want_bf16 = CausalSelfAttention(_cfg(h, hk, d, t, w, "sdpa"), "sdpa", window=w).cuda()
        want_bf16.load_state_dict(flash.state_dict())
        pt = want_bf16(x)
    want = ref(x)  # fp32 throughout
    check_against_torch("flash packed qkv module", got, want, pt, EPS_OUT)
