"""Imported once in the launcher's fork server, so that workers start with it imported.

What every worker imports before its first step, whatever its engines: torch and
torch.distributed, PeerFlow's worker modules, and transformers' model and tokenizer
factories (the model families and tokenizers load through them). Importing must not start
a thread or touch a device: the server forks every worker from this state
(`peerflow.launch.warm`).

The fork server exits when its launcher does; it then skips the interpreter's shutdown
(seconds of torch teardown on a busy machine), so it never holds the caller's stdout and
stderr after the launcher is gone (`peerflow train … | tee` returns at once).
"""

import atexit
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as worker_entry: huggingface_hub reads it now

import torch  # noqa: F401, E402
import torch.distributed  # noqa: F401, E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401, E402

import peerflow.launch.entry  # noqa: F401, E402
import peerflow.worker.main  # noqa: F401, E402

#: The fork server's pid (its forked workers end with `os._exit` and never run atexit).
_SERVER = os.getpid()


def _exit_at_once() -> None:
    if os.getpid() == _SERVER:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if "multiprocessing.forkserver" in " ".join(getattr(sys, "orig_argv", ())):
    atexit.register(_exit_at_once)  # registered last, so it runs first
