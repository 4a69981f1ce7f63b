"""Imported once in the launcher's fork server, so that workers start with it imported.

What every worker imports before its first step, whatever its engines: torch and
torch.distributed, PeerFlow's worker modules, and transformers' model and tokenizer
factories (the model families and tokenizers load through them). Importing must not start
a thread or touch a device: the server forks every worker from this state
(`peerflow.launch.warm`).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as worker_entry: huggingface_hub reads it now

import torch  # noqa: F401, E402
import torch.distributed  # noqa: F401, E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401, E402

import peerflow.launch.entry  # noqa: F401, E402
import peerflow.worker.main  # noqa: F401, E402
