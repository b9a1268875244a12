"""Megatron-core GPT (and MoE) training with TP, PP, DP and EP, as users write it.

    torchrun --nproc-per-node 8 prism/workloads/frameworks/megatron_gpt.py --tp 2 --pp 2
    torchrun --nproc-per-node 8 prism/workloads/frameworks/megatron_gpt.py --pp 2 --experts 4 --ep 2

Megatron-core's own pieces, nothing re-implemented: ``parallel_state``
groups (``tp-cp-ep-dp-pp`` order, so ``rank = tp + TP * (dp + DP * pp)``),
``GPTModel`` with the pure-torch "local" layer spec (no Transformer Engine),
its ``DistributedDataParallel``, the pipeline schedule from
``get_forward_backward_func`` (1F1B with ``--pp`` > 1), ``finalize_model_grads``
and ``get_megatron_optimizer`` (Adam). With ``--experts E`` every layer's MLP
is a mixture of E experts (top-2 router, all-to-all token dispatcher) sharded
over ``--ep`` ranks of the data-parallel dimension.

Weights are initialised on the CPU from ``--seed`` (``use_cpu_initialization``),
so every layout starts from the same model. Each step draws a global batch of
``DP * --micro-batches * --micro-batch-size`` random sequences (seeded by the
step); data-parallel rank d trains on the d-th share.

Output: the rank with tp 0, dp 0 on the last stage prints ``step K loss X``
(the data-parallel mean of the step's mean loss over micro-batches, ``repr``).
Needs CUDA and ``megatron-core`` (``pip install -e .[megatron]``).
"""

import argparse
import os

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description="Megatron-core GPT on random tokens")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: dense MLP)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=None,
                        help="sequences per step over all data-parallel ranks (default: DP x micro-batches x size); "
                             "fixed across layouts so they train on the same data")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.experts and args.tp > 1:
        # Megatron trains MoE with TP only under sequence parallelism, which the
        # local spec's torch LayerNorm refuses (it needs Transformer Engine).
        parser.error("--experts with --tp > 1 needs sequence parallelism, which Megatron-core's local layer spec "
                     "does not support; use --tp 1 with --ep for the MoE layouts")

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if args.experts:
        from megatron.core.transformer.moe import moe_utils

        # megatron-core 0.16.1 without Transformer Engine: the router's gating
        # GEMM tests ``te_general_gemm is not None``, a name only TE's import
        # defines (NameError); None selects its torch.mm path.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    ps.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    per_rank = (args.global_batch or dp * args.micro_batches * args.micro_batch_size) // dp
    micro_batches = per_rank // args.micro_batch_size

    moe = {}
    if args.experts:
        moe = dict(num_moe_experts=args.experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                   moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, add_bias_linear=False)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, **moe)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.experts or None),
                     vocab_size=args.vocab, max_sequence_length=args.seq_len,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).cuda()
    model = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, use_distributed_optimizer=False),
                                 [model])
    fwd_bwd = get_forward_backward_func()
    position_ids = torch.arange(args.seq_len, device="cuda").unsqueeze(0).expand(args.micro_batch_size, -1)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            # The schedule divides the returned loss by the micro-batch count in place: report a copy.
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        ids = torch.randint(0, args.vocab, (dp * per_rank, args.seq_len + 1), generator=g)
        mine = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank].cuda()
        batches = [(mine[i:i + args.micro_batch_size, :-1], mine[i:i + args.micro_batch_size, 1:])
                   for i in range(0, per_rank, args.micro_batch_size)]
        model.zero_grad_buffer()
        opt.zero_grad()
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                         num_microbatches=micro_batches, seq_length=args.seq_len,
                         micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_len,
                         forward_only=False)
        finalize_model_grads([model])
        opt.step()
        if ps.is_pipeline_last_stage():
            loss = torch.stack([x["lm loss"] for x in losses]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            if ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0:
                print(f"step {step} loss {(loss / dp).item()!r}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
