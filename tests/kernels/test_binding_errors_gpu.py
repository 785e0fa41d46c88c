"""Bad input straight to the C++ bindings raises a RuntimeError naming the numbers, instead of
crashing the process (kernels/csrc/check_text.h: on machines whose compiler links libstdc++
statically into the extension, a number streamed into a TORCH_CHECK message killed the process with
SIGSEGV). Each call runs in a child process so that a crash fails one test, not the session.
Skipped without CUDA."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels  # noqa: E402

PRELUDE = """
import torch
from kernels.build import load_extension
ext = load_extension()
bf = dict(device="cuda", dtype=torch.bfloat16)
def r(*shape, **kw):
    return torch.randn(*shape, **{**bf, **kw})
try:
    {call}
except RuntimeError as e:
    print("RAISED:", str(e).splitlines()[0])
else:
    print("NO ERROR")
"""

CASES = {
    # call -> words the message must contain (the numbers of the bad input)
    "ext.wgrad_accumulate(r(48, 24), r(40, 16), torch.zeros(24, 16, device='cuda'))": ["48 rows", "40"],
    "ext.wgrad_accumulate(r(48, 24), r(48, 16), torch.zeros(16, 24, device='cuda'))": ["(24, 16)", "(16, 24)"],
    "ext.wgrad_accumulate(r(48, 20), r(48, 16), torch.zeros(20, 16, device='cuda'))": ["row length 20"],
    "ext.linear_gelu(r(32, 24), r(40, 16), None)": ["24 features", "(40, 16)"],
    "ext.linear_gelu(r(32, 24), r(36, 24), None)": ["hidden size 36"],
    "ext.gelu_backward_bias(r(32, 40), r(32, 48))": ["(32, 40)", "(32, 48)"],
}


@pytest.fixture(scope="module", autouse=True)
def _ext():
    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())


@pytest.mark.parametrize("call", list(CASES))
def test_binding_raises_with_numbers(call):
    code = textwrap.dedent(PRELUDE).replace("{call}", call)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the process died (return code {run.returncode}): {run.stderr[-2000:]}"
    assert "RAISED:" in run.stdout, run.stdout + run.stderr[-2000:]
    message = run.stdout.split("RAISED:", 1)[1]
    for words in CASES[call]:
        assert words in message, message
