"""Arrival counters that let the last program of a split kernel combine the splits."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # graphs captured earlier may still use these


def split_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``pairs`` (sequence, kv head) pairs; the kernel
    leaves them zero, so one buffer per device serves every layer and every replay."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < pairs:
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(pairs, 4096), dtype=torch.int32, device=device)
    return buf
