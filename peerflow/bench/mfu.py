"""Model FLOPs utilisation of a train step on a GPU (the bench and the GPU kit share it)."""

from __future__ import annotations

#: Dense bf16 peak of a device, TFLOPS, by the name `torch.cuda.get_device_name` gives
#: (NVIDIA datasheets: H100 SXM and H200 SXM both 989). Other variants (H100 PCIe, NVL)
#: differ and are left out: their MFU is reported as null with the reason.
PEAK_BF16_TFLOPS = {"H100 SXM": 989.0, "H200": 989.0}


def peak_bf16_tflops(device: str) -> tuple[float | None, str]:
    """(peak dense bf16 TFLOPS, table key) of a device name, or (None, why not)."""
    name = device.upper()
    if any(v in name for v in ("PCIE", "NVL")):
        return None, f"no bf16 peak for {device!r} in PEAK_BF16_TFLOPS (a PCIe/NVL variant)"
    if "H200" in name:
        return PEAK_BF16_TFLOPS["H200"], "H200"
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return PEAK_BF16_TFLOPS["H100 SXM"], "H100 SXM"
    return None, f"no bf16 peak for {device!r} in PEAK_BF16_TFLOPS"


def train_mfu(params: int, tokens: float, seconds: float, device: str
              ) -> tuple[float | None, str]:
    """Model FLOPs utilisation of a train step: 6 x parameters x tokens / seconds / peak.

    Returns (MFU in [0, 1] or None, the peak's table key or why there is no figure). The
    6·N·T count leaves out attention's own FLOPs (a few % at ~1.5 k tokens).
    """
    peak, why = peak_bf16_tflops(device)
    if peak is None:
        return None, why
    if seconds <= 0 or tokens <= 0 or params <= 0:
        return None, f"no train time or tokens (seconds={seconds}, tokens={tokens})"
    return 6.0 * params * tokens / seconds / (peak * 1e12), why
