"""Host arrays to device tensors, the way the step loop needs them on a GPU.

A plain `torch.from_numpy(array).to("cuda")` copies from pageable memory and then waits for the
device to finish everything queued before it (a host sync): a forward whose metadata takes seven
such copies waits seven times. `to_device` copies a forward's arrays in one asynchronous transfer
through pinned memory (PyTorch's caching host allocator keeps the staging buffer alive until the
copy has run), so the host keeps queueing work. On CPU the arrays are simply wrapped, no copy.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Each array (integer or bool) as a tensor on `device`: int64 for integers, bool for bools."""
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]
    sizes = [int(array.size) for array in arrays]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    if sizes:
        np.concatenate([array.ravel() for array in arrays], out=staging.numpy(), casting="unsafe")
    flat = staging.to(device, non_blocking=True)
    return [
        part.view(array.shape).to(torch.bool) if array.dtype == bool else part.view(array.shape)
        for part, array in zip(flat.split(sizes), arrays)
    ]
