"""Peak memory of a step: every run step reports it, `peerflow bench train` reads it.

On an accelerator: the most device memory tensors held
(`torch.accelerator.max_memory_allocated`, reset at the step's start), as
`memory/peak_device_gib`. On the CPU: the process's peak resident set size (`VmHWM`),
reset at the step's start through `/proc/self/clear_refs` where Linux allows it (else
the process's peak since it started), as `memory/peak_rss_gib`. The worker records it
per step, the maximum over ranks (`record_peak`), like the step's times.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def metric_name(device: torch.device) -> str:
    """The metric the step's peak is reported under on `device`."""
    return "memory/peak_rss_gib" if device.type == "cpu" else "memory/peak_device_gib"


def reset_peak(device: torch.device) -> None:
    """Starts a new peak: the device's allocator statistics, or the process's RSS peak."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # not Linux, or not allowed: the peak since the process started


def peak_bytes(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak` (see the module docstring)."""
    if device.type != "cpu":
        return int(torch.accelerator.max_memory_allocated(device))
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rank_device() -> torch.device:
    """Where this rank's engines compute (the device `init_distributed` recorded)."""
    from peerflow.distributed.devices import rank_device as contract_device
    from peerflow.distributed.init import dist_context

    ctx = dist_context()
    return torch.device(ctx.device) if ctx is not None else contract_device()


def record_peak(metrics: Any, device: torch.device) -> None:
    """Adds the peak since the last reset to `metrics` (max over ranks), then resets it.

    Args:
        metrics: A step's `StepMetrics` (its `max(name, value)` keeps the largest over
            ranks).
        device: This rank's device (`rank_device()`).
    """
    metrics.max(metric_name(device), peak_bytes(device) / GIB)
    reset_peak(device)
