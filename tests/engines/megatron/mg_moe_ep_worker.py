"""Worker of `test_megatron_moe_ep.py`: megatron-core's own MoE at ep = 2 on the CPU.

Usage: python mg_moe_ep_worker.py OUT

Builds a 2-layer `GPTModel` with 4 experts (top-2, the allgather token dispatcher,
`SequentialMLP` experts, `moe_enable_routing_replay`) split over expert-parallel size 2,
runs forward and backward over gloo with PeerFlow's CPU redirects, and saves each rank's
expert parameter names and the router's gradient norm. Not the megatron adapter: it
checks what an MoE megatron adapter would stand on.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from peerflow.adapters.megatron.cpu import enable_redirects

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 leaves it undefined without TE
        moe_utils.te_general_gemm = None
    enable_redirects("cpu")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=2, moe_grouped_gemm=False, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32,
        moe_enable_routing_replay=True)
    model = GPTModel(config=config, vocab_size=64, max_sequence_length=32,
                     transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=4, moe_grouped_gemm=False),
                     position_embedding_type="rope")
    enable_redirects("cpu")  # Megatron modules imported by the build
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    logits = model(input_ids=ids, position_ids=torch.arange(8)[None].expand(2, -1),
                   attention_mask=None)
    logits.float().pow(2).mean().backward()
    router = model.decoder.layers[0].mlp.router.weight
    torch.save({"experts": [n for n, _ in model.named_parameters() if ".experts." in n],
                "router_grad": float(router.grad.norm()), "shape": tuple(logits.shape)},
               os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
