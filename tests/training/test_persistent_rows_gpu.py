"""training/compile/persistent_rows.py on CUDA: with the rule a compiled LayerNorm over a 2560-wide row is one
persistent kernel (its name starts triton_per_) and gives eager's result; with the rule off inductor
loops over the row (triton_red_). Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from training.compile import persistent_rows  # noqa: E402


def layer_norm_kernels(width):
    torch._dynamo.reset()
    torch.manual_seed(width)
    x = torch.randn(333, width, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w, b = torch.randn(width, device="cuda"), torch.randn(width, device="cuda")

    def ln(x, w, b):
        return F.layer_norm(x.float(), (width,), w, b).to(torch.bfloat16)

    # no FX graph cache: the second compile of this graph must generate its kernels under the rule in force
    compiled = torch.compile(ln, options={"triton.multi_kernel": 0, "fx_graph_cache": False})
    out = compiled(x, w, b)
    torch.testing.assert_close(out.float(), ln(x, w, b).float(), rtol=2e-2, atol=2e-2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(x, w, b)
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if e.key.startswith("triton_")]


def test_rule_makes_the_row_persistent_and_off_leaves_it_looped():
    try:
        assert persistent_rows.install(4096)
        names = layer_norm_kernels(2560)
        assert names and all(n.startswith("triton_per_") for n in names), names
        persistent_rows.install(0)
        names = layer_norm_kernels(2560)
        assert names and all(n.startswith("triton_red_") for n in names), names
    finally:
        persistent_rows.install(0)
        torch._dynamo.reset()
