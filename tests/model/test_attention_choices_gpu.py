"""model.attention=math, sdpa_flash and sdpa_cudnn on CUDA in bf16 against the fp32 reference (each within 2x
PyTorch's own bf16 error, as tests/kernels do), grouped-query heads included; each compiles (fullgraph) to its
own kernels; math recomputed keeps no score matrix on the GPU. Skipped without CUDA."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch._inductor.utils import run_and_get_code  # noqa: E402

from gpu_util import max_err  # noqa: E402
from kernels.reference import attention_ref  # noqa: E402
from model.attention import AttentionUnavailable, CausalSelfAttention, resolve_backend  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

EPS_OUT, EPS_GRAD = 1e-4, 1e-3
CUDA = torch.device("cuda")
# the aten op each backend's SDPA call must become, eager and compiled
ATEN = {"sdpa_flash": "_scaled_dot_product_flash_attention", "sdpa_cudnn": "_scaled_dot_product_cudnn_attention"}


@pytest.mark.parametrize("backend", ["math", "sdpa_flash", "sdpa_cudnn"])
@pytest.mark.parametrize("b,t,h,hk,d", [(2, 1024, 4, 4, 128), (1, 777, 8, 2, 64), (3, 129, 2, 1, 128),
                                        (1, 2048, 2, 2, 64)])
def test_bf16_against_the_fp32_reference(backend, b, t, h, hk, d):
    cfg = GPTConfig(d_model=h * d, n_head=h, n_kv_head=hk, seq_len=t, attention=backend)
    assert resolve_backend(backend, CUDA, d, torch.bfloat16)[0] == backend
    attn = CausalSelfAttention(cfg, backend)
    torch.manual_seed(t + d)
    q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # (B, T, H, D)
    k, v = (torch.randn(b, t, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16)
    out = attn._torch(q, k, v, None)  # the module's attention core: GQA repeat, then the backend
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(qf, kf, vf, causal=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for name, ours, r, p, eps in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads),
                                     (pt, *pt_grads), (EPS_OUT, EPS_GRAD, EPS_GRAD, EPS_GRAD)):
        assert torch.isfinite(ours).all(), name
        e, e_pt = max_err(ours, r), max_err(p, r)
        assert e <= 2 * e_pt + eps, f"{backend} {name}: max err {e:.3e} > 2 x torch's {e_pt:.3e} + {eps}"


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn"])
def test_fp32_attention_is_refused_where_the_backend_takes_16_bit_only(backend):
    with pytest.raises(AttentionUnavailable, match=f"model.attention={backend} cannot run on cuda in float32.*"
                                                   "use model.attention=sdpa"):
        resolve_backend(backend, CUDA, 64, torch.float32)


@pytest.mark.parametrize("backend", ["math", "sdpa_flash", "sdpa_cudnn"])
def test_compiled_model_runs_its_own_kernels(backend):
    """The GPT compiled with fullgraph=True under bf16 autocast: the forward and backward call the backend's
    op (ours for math, the one SDPA backend otherwise) and the loss is the eager one."""
    cfg = GPTConfig(n_layer=2, d_model=256, n_head=2, vocab_size=512, seq_len=256, attention=backend, mlp="torch")
    torch.manual_seed(0)
    model = GPT(cfg, device=CUDA).cuda()
    idx = torch.randint(0, 512, (2, 256), device="cuda")

    def step(m):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(idx, idx.roll(-1, 1))
        loss.backward()
        return loss.detach().float()

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        loss, code = run_and_get_code(step, torch.compile(model, fullgraph=True))
    code = "\n".join(code)  # the forward's and the backward's generated code
    if backend == "math":
        assert "flashgpt.math_attn_fwd" in code and "flashgpt.math_attn_bwd" in code
        assert "scaled_dot_product" not in code
    else:
        assert ATEN[backend] + ".default" in code and ATEN[backend] + "_backward" in code, code[-3000:]
    torch.testing.assert_close(loss, step(model), rtol=2e-3, atol=2e-3)


def test_recomputed_math_keeps_no_score_matrix_on_the_gpu():
    """Peak memory of forward + backward at 4k tokens, 8 heads: without recompute every layer keeps its
    probabilities (8 x 4k x 4k bf16 = 256 MiB) for the backward, with recompute_attention only the layer in
    its backward has them; the loss and gradients agree within fp32 rounding."""
    peaks, results = {}, {}
    for recompute in (False, True):
        cfg = GPTConfig(n_layer=4, d_model=512, n_head=8, vocab_size=512, seq_len=4096, attention="math",
                        mlp="torch", recompute_attention=recompute)
        torch.manual_seed(0)
        model = GPT(cfg, device=CUDA).cuda()
        idx = torch.randint(0, 512, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        torch.cuda.synchronize()
        peaks[recompute] = torch.cuda.max_memory_allocated()
        results[recompute] = (loss.detach(), [p.grad for p in model.parameters()])
        del model, loss
    # the backward's peak: 4 layers' probabilities + dP, dS without; the recomputed layer's + dP, dS with
    assert peaks[False] - peaks[True] > 2 * 256 * 2 ** 20, peaks
    torch.testing.assert_close(results[True][0], results[False][0])
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b)


def test_math_under_autocast_keeps_its_probabilities_in_bf16():
    """Under bf16 autocast with fp32 leaves (as the trainer runs), the math backend's saved P is bf16 -- CUDA's
    autocast would otherwise write softmax in fp32 -- and its output and gradients match the fp32 reference
    within 2x PyTorch's own bf16 error."""
    from model.materialized_attention import _fwd_op, materialized_attention
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", requires_grad=True) for _ in range(3))  # (B, T, H, D)
    dout = torch.randn(2, 333, 4, 64, device="cuda")
    bhtd = [x.transpose(1, 2) for x in (q, k, v)]  # the op's (B, H, T, D)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_p = _fwd_op(*(x.bfloat16() for x in bhtd), None, 64 ** -0.5, True)
        out = materialized_attention(*bhtd).transpose(1, 2)
    assert [t.dtype for t in out_p] == [torch.bfloat16, torch.bfloat16]
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out, (q, k, v), dout.bfloat16())
    ref, _ = attention_ref(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    pt, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, upcast=False)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout.bfloat16())
    for name, ours, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (pt, *pt_grads)):
        assert torch.isfinite(ours).all(), name
        e, e_pt = max_err(ours, r), max_err(p, r)
        assert e <= 2 * e_pt + EPS_GRAD, f"math {name}: max err {e:.3e} > 2 x torch's {e_pt:.3e}"
