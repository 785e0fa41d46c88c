"""Context parallelism: one window of T tokens held by C ranks as C consecutive slices of T/C tokens.

The model stays single-device: each attention module has a `context_parallel` slot (None on one device)
that the engine fills with a wrapper from here (`attach`), which exchanges the slices around the module's
own attention. ulysses.py: DeepSpeed-Ulysses, an all-to-all over heads (each rank attends over the full
sequence for H/C of the heads).
"""
from training.context_parallel.ulysses import UlyssesAttention, attach, check_heads, detach

__all__ = ["UlyssesAttention", "attach", "check_heads", "detach"]
