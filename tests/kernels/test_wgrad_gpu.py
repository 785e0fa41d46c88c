"""GPU checks of the weight-gradient GEMM that accumulates into fp32 (kernels/wgrad.py,
csrc/mlp/wgrad_api.cpp): against torch's fp32 addmm of the same 16-bit operands (tolerance: 2 x
torch's own error against fp64 + a small eps), accumulating onto a random buffer, odd row counts;
the Linear and the fused MLP with it, eager and compiled; the trainer's step with it against the fold.
Skipped without CUDA."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import ext, fresh_factory, require_extension  # noqa: E402
from kernels.gelu_mlp import gelu_mlp  # noqa: E402
from kernels.wgrad import accumulate, linear, reference_accumulate  # noqa: E402

EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _ext():
    require_extension()


fresh = fresh_factory(4242)


def assert_close_to_fp64(ours, torch_fp32, exact, what):
    err = (ours.double() - exact).abs().max().item()
    torch_err = (torch_fp32.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert torch.isfinite(ours).all(), what
    assert err <= 2 * torch_err + EPS * scale, f"{what}: ours {err:.3e} vs torch {torch_err:.3e} (max {scale:.2e})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 8, 8), (37, 40, 24), (4099, 136, 520), (8192, 2048, 1024), (3001, 6144, 2048)])
def test_binding_adds_the_product_into_fp32(m, n, k, dtype):
    """Two micro-batches onto a random fp32 buffer: buffer + dy1^T x1 + dy2^T x2."""
    main = fresh(n, k, dtype=torch.float32)
    ref, exact = main.clone(), main.double()
    for _ in range(2):
        dy, x = fresh(m, n, dtype=dtype), fresh(m, k, dtype=dtype)
        ext().wgrad_accumulate(dy, x, main)
        reference_accumulate(dy, x, ref)
        exact += dy.double().t() @ x.double()
    torch.cuda.synchronize()
    assert_close_to_fp64(main, ref, exact, f"{m}x{n}x{k}")


def test_bad_buffers_get_one_clear_error():
    """Checked in Python before the binding is called (on the lent machines a C++ TORCH_CHECK message
    with a number in it can crash the process: csrc/check_text.h)."""
    dy, x = fresh(64, 48), fresh(64, 32)
    with pytest.raises(ValueError, match="main_grad must be float32"):
        accumulate(dy, x, torch.zeros(48, 32, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="shape"):
        accumulate(dy, x, torch.zeros(32, 48, device="cuda"))
    with pytest.raises(ValueError, match="shape"):
        accumulate(dy, fresh(63, 32), torch.zeros(48, 32, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        accumulate(dy, x, torch.zeros(32, 48, device="cuda").t())
    with pytest.raises(ValueError, match="device"):
        accumulate(dy, x.cpu(), torch.zeros(48, 32, device="cuda"))
    # a non-contiguous operand is made contiguous, not refused
    main, ref = torch.zeros(48, 32, device="cuda"), torch.zeros(48, 32, device="cuda")
    xt = fresh(32, 64).t()
    accumulate(dy, xt, main)
    reference_accumulate(dy, xt, ref)
    assert (main - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_opcheck():
    from kernels.wgrad import accumulate_op

    torch.library.opcheck(accumulate_op, (fresh(40, 24), fresh(40, 16), fresh(24, 16, dtype=torch.float32)))


@pytest.mark.parametrize("compiled", [False, True])
def test_linear_under_autocast(compiled):
    """The weight cache's situation: fp32 x, bf16 weight copy, bf16 autocast, odd row count."""
    fn = torch.compile(linear, fullgraph=True) if compiled else linear
    x, dy = fresh(3, 333, 256, dtype=torch.float32), fresh(3, 333, 384)
    w, b = fresh(384, 256, scale=256 ** -0.5).requires_grad_(), fresh(384).requires_grad_()
    xs, main = x.clone().requires_grad_(), fresh(384, 256, dtype=torch.float32)
    start = main.clone()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(xs, w, b, main)
        y_ref = F.linear(x, w.detach(), b.detach())
    assert y.dtype == torch.bfloat16 and (y.float() - y_ref.float()).abs().max().item() < 1e-2
    y.backward(dy)
    assert w.grad is None and b.grad is not None and xs.grad.dtype == torch.float32
    x16, dy2 = x.bfloat16().reshape(-1, 256), dy.reshape(-1, 384)
    exact = dy2.double().t() @ x16.double()
    assert_close_to_fp64(main - start, dy2.float().t() @ x16.float(), exact, "dw")
    dx_exact = dy2.double() @ w.detach().double()
    assert (xs.grad.reshape(-1, 256).double() - dx_exact).abs().max().item() < 2e-2 * dx_exact.abs().max().item()


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_mlp_puts_both_weight_gradients_into_main_grads(compiled):
    fn = torch.compile(gelu_mlp, fullgraph=True) if compiled else gelu_mlp
    m, d, h = 1001, 256, 1024
    x, dy = fresh(m, d), fresh(m, d)
    w1, b1 = fresh(h, d, scale=d ** -0.5), fresh(h, scale=0.5)
    w2, b2 = fresh(d, h, scale=h ** -0.5), fresh(d, scale=0.5)
    plain = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    gelu_mlp(*plain).backward(dy)
    mains = [fresh(h, d, dtype=torch.float32), fresh(d, h, dtype=torch.float32)]
    starts = [t.clone() for t in mains]
    ours = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    fn(*ours, *mains).backward(dy)
    assert ours[1].grad is None and ours[3].grad is None
    for i in (0, 2, 4):  # dx, db1, db2: the same computation either way
        torch.testing.assert_close(ours[i].grad, plain[i].grad)
    for main, start, w in zip(mains, starts, (plain[1], plain[3])):
        # plain's dw is the bf16-rounded product; ours is the fp32 one: within bf16's rounding
        diff = (main - start - w.grad.float()).abs().max().item()
        assert diff <= 2 ** -8 * w.grad.float().abs().max().item() + 1e-6, diff


@pytest.mark.parametrize("mlp", ["fused", "torch"])
@pytest.mark.parametrize("compile", [False, True])
def test_trainer_step_with_fp32_weight_gradients_matches_the_fold(compile, mlp):
    """The engine on CUDA (bf16 autocast, weight cache): engine.wgrad_fp32 auto (on here) against
    disabled, three micro-batches: the same losses and the same gradients within bf16's rounding of
    the folded ones (compiled attention Linears that accumulate wrongly are 8-18% off, kernels/NOTES.md)."""
    from model.gpt import GPT
    from training.config import load_config
    from training.distributed import DistInfo
    from training.engines.replicas import TorchEngine

    def engine(*extra):
        cfg = load_config("tiny_cpu.yaml", ["model.n_layer=2", "model.d_model=256", "model.n_head=2",
                                            "model.vocab_size=512", "model.seq_len=256", "data.tokenizer_vocab_size=512",
                                            "train.device=cuda", "train.dtype=bf16", "train.micro_batch_size=2",
                                            "train.global_batch_size=6", f"train.compile={str(compile).lower()}",
                                            f"model.mlp={mlp}", *extra])
        torch.manual_seed(0)
        return TorchEngine(GPT(cfg.model, device=torch.device("cuda")), cfg, DistInfo(device=torch.device("cuda")))

    on, fold = engine(), engine("engine.wgrad_fp32=disabled")
    assert on.weight_cache.accumulated and not fold.weight_cache.accumulated
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        t = torch.randint(0, 512, (2, 257), generator=g)
        batch = SimpleNamespace(x=t[:, :-1], y=t[:, 1:])
        loss_on, loss_fold = on.forward_backward(batch, sync=True), fold.forward_backward(batch, sync=True)
        assert abs(loss_on.item() - loss_fold.item()) <= 1e-4 * loss_fold.item()
    rel = {}  # relative L2 difference per parameter (compiled graphs differ in their fusions, so
    for (name, p), q in zip(on.model.named_parameters(), fold.model.parameters()):  # single elements
        assert q.grad.abs().max().item() > 0, name  # round differently: norms, as test_gpt_gpu.py)
        rel[name] = ((p.grad - q.grad).norm() / q.grad.norm()).item()
    worst = sorted(rel.items(), key=lambda kv: -kv[1])[:4]
    print("relative L2 difference, largest:", ", ".join(f"{n} {r:.2e}" for n, r in worst))
    assert worst[0][1] < 5e-3, worst  # bf16 rounding of the folded weight gradients: ~1.7e-3
