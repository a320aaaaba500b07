"""Where an adapter's call runs, and index tensors that device can read."""

from __future__ import annotations

import torch



def launch_device(*items) -> torch.device:
    """The first non-CPU device among tensors and bound caches (CPU when all are on the host)."""
    for item in items:
        device = item.device
        if device.type != "cpu":
            return device
    return torch.device("cpu")


def indices_on(idx, device: torch.device) -> torch.Tensor:
    """An int index tensor the launch device can read: host indices are copied there unless pinned."""
    if not isinstance(idx, torch.Tensor):
        idx = torch.as_tensor(idx, dtype=torch.int64)
    if idx.device != device and not (idx.device.type == "cpu" and idx.is_pinned()):
        idx = idx.to(device, non_blocking=True)
    return idx


__all__ = ["launch_device", "indices_on"]
