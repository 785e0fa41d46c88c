"""nn.Linear with an optional fp32 gradient buffer its weight gradient is added into: the model's slot of
the fp32 weight-gradient feature, which training/engines/weight_cache.py owns (it fills the slot).

`main_grad` is a non-persistent buffer, None by default: then this is nn.Linear. The trainer sets it
from outside, through `torch.func.functional_call`, to the fp32 weight's .grad when the model runs on
bf16 copies of its weights (training/engines/weight_cache.py); the backward's weight-gradient GEMM then adds
its fp32 result straight into that buffer (kernels/wgrad.py) instead of returning a bf16 gradient for
a second kernel to add. Checkpoints and the module's parameters do not change. Used by every
projection of a block: attention's qkv / proj and the MLP's fc / proj.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("main_grad", None, persistent=False)  # (out, in) fp32 when set

    def forward(self, x):  # (..., in) -> (..., out)
        if self.main_grad is None:
            return F.linear(x, self.weight, self.bias)
        from kernels.wgrad import linear  # torch-only; the CUDA extension loads on first use

        return linear(x, self.weight, self.bias, self.main_grad)
