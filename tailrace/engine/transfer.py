"""Host <-> device copies that never wait for the device.

A plain `torch.tensor(values, device="cuda")` or `.to("cuda")` of pageable memory synchronizes
the stream: the host waits for every kernel queued before it. The engine queues a whole step
(forward, sampling) before it reads anything back, so each small tensor it sends on the way goes
through pinned memory with `non_blocking=True` instead, and results come back the same way, with
one wait for all of them. On CPU both are the plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | torch.Tensor, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `values` on `device`, queued after the work already on the stream."""
    if device.type == "cpu":
        return values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if isinstance(values, torch.Tensor):
        pinned = values.pin_memory()
    else:
        pinned = torch.tensor(values, dtype=dtype, pin_memory=True)
    return pinned.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, valid once an event recorded after it has completed."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after everything queued so far on the device's stream; None on CPU (nothing is queued)."""
    if device.type == "cpu":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
