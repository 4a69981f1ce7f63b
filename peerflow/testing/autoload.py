"""How a process gets the emulated accelerator: torch's device-extension hook, armed by env.

PeerFlow's production code never imports `peerflow.testing`: it asks `torch.accelerator`
which device to compute on (`peerflow.distributed.devices`), as it does on a GPU. The
emulation reaches a process the way an out-of-tree device does (torch_npu, the Intel
extension): through the `torch.backends` entry point group, which `import torch` loads in
every process (torch's device-extension autoloading, on unless
`TORCH_DEVICE_BACKEND_AUTOLOAD=0`). PeerFlow's wheel registers `arm` there.

`arm` does nothing unless `$PEERFLOW_EMULATE_ACCELERATOR` is "1". Then it installs nothing
yet either: torch is still importing (a backward pass now would deadlock), and the launch's
fork server imports torch and transformers (which asks `torch.accelerator` at import) once
for every worker it forks, before a worker has its `$LOCAL_RANK` and `$LOCAL_WORLD_SIZE`.
So `arm` wraps `torch.accelerator`'s `is_available`, `current_accelerator` and
`device_count`: a question asked while a module is being imported is answered as before
(the host's), and the first one asked outside an import installs the emulation
(`emulated_device.install`) and is answered from it — in the process that asks where to
compute (`peerflow.distributed.devices`), with its own environment, before its first
backward pass. That is where PeerFlow used to install it itself.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from peerflow.testing.env import ENV_VAR

#: The `torch.accelerator` functions whose first call installs the emulation.
TRIGGERS = ("is_available", "current_accelerator", "device_count")


def arm() -> None:
    """The `torch.backends` entry point: arms the install when `$PEERFLOW_EMULATE_ACCELERATOR=1`.

    Called by torch at the end of `import torch`; imports nothing from torch beyond what
    is already loaded.
    """
    if os.environ.get(ENV_VAR) != "1":
        return
    import torch

    accelerator = torch.accelerator
    originals = {name: getattr(accelerator, name) for name in TRIGGERS}
    for name, original in originals.items():
        setattr(accelerator, name, _first_call(name, original, originals))


def _first_call(name: str, original: Callable[..., Any],
                originals: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    """A stand-in for `torch.accelerator.<name>` that installs the emulation first."""

    @functools.wraps(original)
    def install_then_call(*args: Any, **kwargs: Any) -> Any:
        if _importing():
            return original(*args, **kwargs)
        import torch

        from peerflow.testing.emulated_device import install

        for trigger, function in originals.items():
            if getattr(torch.accelerator, trigger) is not function:
                setattr(torch.accelerator, trigger, function)
        install()
        return getattr(torch.accelerator, name)(*args, **kwargs)

    return install_then_call


def _importing() -> bool:
    """Whether this call comes from a module's import (a library probing the device)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == "<frozen importlib._bootstrap>":
            return True
        frame = frame.f_back
    return False
