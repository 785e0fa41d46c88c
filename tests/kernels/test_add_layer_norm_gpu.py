"""GPU checks of the residual add + LayerNorm kernels (csrc/norm/add_layer_norm.cu): forward and
backward against the same math in fp32 torch ops (kernels/add_layer_norm.py's reference), odd row
counts, widths whose thread count is not a whole number of warps, bf16 / fp16, with and without bias;
the op's errors; a compiled GPT with model.fused_add_norm against the same GPT without it. Skipped
without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import ext, fresh_factory, require_extension  # noqa: E402
from kernels.add_layer_norm import reference_backward, reference_forward  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _ext():
    require_extension()


fresh = fresh_factory(991)


def close(ours, ref, rel, what):
    err = (ours.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert torch.isfinite(ours).all() and err <= rel * scale + 1e-6, f"{what}: {err:.3e} (max {scale:.3e})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d", [(1, 8), (37, 104), (4099, 2560), (513, 2048), (7, 8192), (300, 1032)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_kernels_match_the_reference(rows, d, dtype, with_bias):
    x, delta = fresh(rows, d, dtype=dtype, scale=2.0), fresh(rows, d, dtype=dtype)
    w = 1 + 0.2 * fresh(d, dtype=torch.float32)
    b = 0.3 * fresh(d, dtype=torch.float32) if with_bias else None
    h, y, rstd = ext().add_layer_norm_fwd(x, delta, w, b, 1e-5)
    h_ref, y_ref, rstd_ref = reference_forward(x, delta, w, b, 1e-5)
    assert torch.equal(h, h_ref)  # the same fp32 add, rounded once
    close(y, y_ref, 2 ** -7, "y")
    close(rstd, rstd_ref, 1e-5, "rstd")
    dh_in, dy = fresh(rows, d, dtype=dtype), fresh(rows, d, dtype=dtype)
    out = ext().add_layer_norm_bwd(dh_in, dy, y, w, b, rstd)
    dh_ref, dw_ref, db_ref = reference_backward(dh_in, dy, y, w, b, rstd)
    close(out[0], dh_ref, 2 ** -7, "dh")
    close(out[1], dw_ref, 1e-5, "dweight")
    if with_bias:
        close(out[2], db_ref, 1e-5, "dbias")
    else:
        assert len(out) == 2


def test_empty_and_bad_inputs():
    w = torch.ones(16, device="cuda")
    h, y, rstd = ext().add_layer_norm_fwd(fresh(0, 16), fresh(0, 16), w, None, 1e-5)
    assert h.shape == y.shape == (0, 16) and rstd.shape == (0,)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext().add_layer_norm_fwd(fresh(4, 12), fresh(4, 12), torch.ones(12, device="cuda"), None, 1e-5)
    with pytest.raises(RuntimeError, match="delta"):
        ext().add_layer_norm_fwd(fresh(4, 16), fresh(4, 16, dtype=torch.float16), w, None, 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ext().add_layer_norm_fwd(fresh(4, 16), fresh(4, 16), w.bfloat16(), None, 1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_with_fused_add_norm_matches_without(compiled):
    """A bf16-autocast step of a small GPT on the GPU (our attention and MLP), bf16 residual stream."""
    from model.config import GPTConfig
    from model.gpt import GPT

    results = {}
    for fused in (False, True):
        cfg = GPTConfig(n_layer=3, d_model=256, n_head=2, vocab_size=512, seq_len=256, residual="autocast",
                        norm_saves_output=True, fused_add_norm=fused)
        torch.manual_seed(0)
        model = GPT(cfg, device=torch.device("cuda")).cuda()
        run = torch.compile(model) if compiled else model
        idx = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, idx)
        loss.backward()
        results[fused] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch._dynamo.reset()
    (l0, g0), (l1, g1) = results[False], results[True]
    assert abs(l0 - l1) < 1e-2 and g0.keys() == g1.keys()
    for name in g0:
        close(g1[name], g0[name], 0.05, name)
