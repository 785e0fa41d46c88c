"""flashgpt kernels: our FlashAttention-2 CUDA kernels (forward + backward) as torch.library ops.

    from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func, is_available

Importing is cheap and works on a CPU-only machine without nvcc: the CUDA extension is built
(JIT, cached) on the first kernel call, on is_available(), or with `python -m kernels.build`.
Note: `kernels` is also the name of an unrelated registry package; this one is the repository's
folder (installed editable), which a test checks.
"""
from .flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func


def is_available() -> bool:
    """True only if CUDA is present AND the extension builds/loads (may trigger the build)."""
    from .build import is_available as _is_available

    return _is_available()


def unavailable_reason() -> str:
    """Why is_available() is False ('' when it is True)."""
    from .build import unavailable_reason as _reason

    return _reason()


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "is_available",
           "unavailable_reason"]
