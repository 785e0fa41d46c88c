"""A context rank's slice of a micro-batch: tokens [r*T/C, (r+1)*T/C) of every sequence of x and y,
with the position of its first token (learned positions and RoPE continue from there) and, with
data.doc_boundaries, the cu_seqlens / max_seqlen of the WHOLE window (the attention runs over the
whole window after the all-to-all, so document starts are those of the full (B, T) batch)."""
from __future__ import annotations

from dataclasses import dataclass

from data.loader import Batch
from training.context_parallel.groups import ContextLayout


@dataclass
class SlicedBatch(Batch):
    position_offset: int = 0  # the slice's first token's position in its window

    def to(self, device, non_blocking: bool = True) -> "SlicedBatch":
        moved = super().to(device, non_blocking)
        return SlicedBatch(moved.x, moved.y, moved.cu_seqlens, moved.max_seqlen, self.position_offset)


def slice_batch(batch: Batch, layout: ContextLayout) -> Batch:
    """This rank's (B, T/C) slice of a (B, T) batch; the batch itself when C == 1."""
    if not layout.enabled:
        return batch
    T = batch.x.shape[1]
    if T % layout.size:
        raise ValueError(f"a window of {T} tokens does not split into {layout.size} equal slices")
    n = T // layout.size
    lo = layout.rank * n
    return SlicedBatch(batch.x[:, lo:lo + n].contiguous(), batch.y[:, lo:lo + n].contiguous(),
                       batch.cu_seqlens, batch.max_seqlen, lo)
