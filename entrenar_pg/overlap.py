"""Whether a tensor has elements that share memory (an ``expand()``ed tensor, say).

A collective that writes such a tensor cannot store its result: torch refuses
the copy, but only after the bytes moved, and the failed job breaks the group.
So the adapter refuses it in the caller's thread, before anything is sent.
Every collective checks its outputs, so the common case (a contiguous
tensor, which never overlaps itself) costs one ``is_contiguous`` call.
"""

from __future__ import annotations

import torch


def overlaps_itself(t: torch.Tensor) -> bool:
    """True if two elements of ``t`` share a memory location."""
    if t.is_contiguous():
        return False
    # Strides in increasing order: if each stride steps past everything the
    # smaller ones reach, every element has its own offset (dense tensors in
    # any dimension order, slices with steps, transposes).
    dims = sorted(
        (stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1
    )
    reach = 0  # the furthest offset the dimensions so far reach
    for stride, size in dims:
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    if dims[0][0] == 0:  # a broadcast dimension: every step lands on the same element
        return True
    # Interleaved strides (e.g. sizes (3, 2), strides (2, 3)) may or may not
    # collide: count the distinct offsets. Rare, and linear in the elements.
    offsets = torch.zeros(1, dtype=torch.int64)
    for stride, size in dims:
        steps = torch.arange(size, dtype=torch.int64) * stride
        offsets = (offsets[:, None] + steps).reshape(-1)
    return int(torch.unique(offsets).numel()) != offsets.numel()
