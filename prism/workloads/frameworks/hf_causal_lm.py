"""A Hugging Face transformers causal LM trained with DDP or FSDP2, as users write it.

    torchrun --nproc-per-node 4 prism/workloads/frameworks/hf_causal_lm.py --model llama --parallel ddp
    torchrun --nproc-per-node 4 prism/workloads/frameworks/hf_causal_lm.py --model qwen3-moe --parallel fsdp2

The model is built from a config (``LlamaConfig`` or ``Qwen3MoeConfig``),
randomly initialised with ``--seed`` (no download), small enough for a CPU.
Each step draws a global batch of ``WORLD_SIZE * --batch`` sequences of
random token ids (seeded by ``--seed`` and the step); rank r trains on the
r-th share with ``labels=input_ids`` (the model's own shifted cross-entropy).

``--parallel ddp``     ``DistributedDataParallel`` (the MoE's experts are
                       3-D parameters, so every parameter gets a gradient).
``--parallel fsdp2``   ``fully_shard`` on every decoder layer, then the root.

Output: rank 0 prints ``step K loss X`` (the global-batch mean loss,
all-reduced, ``repr``), for the MoE model ``step K routing C0,C1,...`` (how
many of the step's tokens, over all ranks, the first layer's router sent to
each expert: what the real run routed), and ``param checksum X`` at the end.
Needs ``transformers`` (``pip install -e .[hf]``).
"""

import argparse
import os

import torch
import torch.distributed as dist


def build(name: str, args):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                  max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    if name == "llama":
        config = LlamaConfig(intermediate_size=2 * args.hidden, **common)
    else:
        config = Qwen3MoeConfig(intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden,
                                num_experts=args.experts, num_experts_per_tok=2, decoder_sparse_step=1,
                                head_dim=args.hidden // args.heads, **common)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config)


def main():
    parser = argparse.ArgumentParser(description="HF causal LM training on random tokens")
    parser.add_argument("--model", choices=("llama", "qwen3-moe"), default="llama")
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default=None,
                        help="torch.distributed backend (default: nccl with CUDA, else gloo; gloo on CUDA tensors "
                             "runs two ranks on one GPU, which NCCL refuses)")
    args = parser.parse_args()

    dist.init_process_group(args.backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        # one GPU per rank, or ranks sharing the GPUs there are (gloo on CUDA tensors)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(args.seed)
    model = build(args.model, args).to(device)
    moe = args.model == "qwen3-moe"
    routed = []
    if moe:
        # What the first layer's router chose, as it happened in this step.
        gate = model.model.layers[0].mlp.gate
        gate.register_forward_hook(lambda mod, inp, out: routed.append(out[2].detach().flatten()))
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        net = model
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)

    for step in range(args.steps):
        g = torch.Generator().manual_seed(args.seed * 1000 + step)
        ids = torch.randint(0, args.vocab, (world * args.batch, args.seq_len), generator=g)
        ids = ids[rank * args.batch:(rank + 1) * args.batch].to(device)
        routed.clear()
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, op=dist.ReduceOp.SUM)
        if moe:
            counts = torch.bincount(torch.cat(routed), minlength=args.experts).to(device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"step {step} loss {(reported / world).item()!r}", flush=True)
            if moe:
                print(f"step {step} routing {','.join(str(int(c)) for c in counts.tolist())}", flush=True)

    if args.parallel == "fsdp2":
        total = sum(p.full_tensor().double().sum() for p in model.parameters())
    else:
        total = sum(p.detach().double().sum() for p in model.parameters())
    if rank == 0:
        print(f"param checksum {total.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
