"""A small GPT decoder trained with Megatron-style TP, PP, DP and EP.

An ordinary ``torch.distributed`` training script: it never imports Prism.
Launch it like any torchrun job::

    torchrun --nproc-per-node 16 -m prism.workloads.gpt --tp 2 --pp 2 --dp 4
    python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        prism/workloads/gpt.py --tp 2 --dp 2 --ep 2 --experts 4

With ``--tp 1 --pp 1 --dp 1`` and no ``WORLD_SIZE`` in the environment it runs
as a world of one without a launcher.

Rank layout (Megatron-LM's default order; TP fastest, then DP, then PP)::

    rank = tp_rank + TP * (dp_rank + DP * pp_rank)
    ep_rank = dp_rank % EP          (EP groups: consecutive DP ranks)

Process groups are created with ``dist.new_group`` on every rank in this order
(each group's ranks in increasing order; loops nest left to right, outermost
first):

1. TP groups, for pp_rank, for dp_rank: the TP ranks.
2. DP groups, for pp_rank, for tp_rank: the DP ranks.
3. Pipeline groups, for dp_rank, for tp_rank: the PP stages (activations,
   gradients and the loss travel inside them).
4. MoE only (``--experts > 0``): EP groups, for pp_rank, for tp_rank, for each
   block of EP consecutive DP ranks.
5. MoE only: expert-DP groups (ranks holding the same experts), for pp_rank,
   for tp_rank, for ep_rank: the DP ranks with that ep_rank.

Groups of one rank are created like the others, but no collective is issued on
them.

Model: token and position embeddings, ``--layers`` pre-LayerNorm blocks
(causal self-attention, then a GELU MLP or a dropless top-k MoE), a final
LayerNorm and an LM head; no biases besides LayerNorm's. Cross-entropy on
synthetic token sequences ``(start + stride * t) % vocab`` whose starts and
strides come from a generator seeded by ``--seed`` and the step, so the loss
falls as the model learns them. Every weight is drawn on its full, unsharded
shape from a generator seeded by ``--seed`` and the weight's name, then sliced,
so any layout computes the same function as one rank (up to float rounding).

- TP: QKV and MLP-up (and each expert's up projection) are column-parallel,
  attention-out and MLP-down row-parallel; heads and the MLP hidden size are
  split across TP. The row-parallel output is all-reduced in forward, the
  column-parallel input gradient in backward. Embeddings, LayerNorms, the
  router and the head are replicated across TP.
- PP: layers split into contiguous stages (stage p holds layers
  ``[p*L//PP, (p+1)*L//PP)``); 1F1B schedule over ``--micro-batches``
  micro-batches with isend/irecv between neighbouring stages (even stages post
  the send first, odd stages the receive, as Megatron-LM does).
- DP: each step's global batch has ``DP * micro_batches * batch`` sequences;
  DP rank d takes the d-th contiguous share. After backward, gradients are
  summed over the DP group (one flat all_reduce) and divided by DP.
- EP (MoE): each EP group holds all ``--experts`` experts, ``experts / EP`` per
  rank. Per-expert token counts are exchanged with ``all_to_all_single``, then
  the tokens with ``all_to_all_single`` and those split sizes, and the outputs
  come back with the reverse exchange. Expert gradients are summed over the
  expert-DP group and divided by DP (every DP rank's tokens reach them).

Output (stdout, flushed; other tools parse these lines):

- ``step K loss X``: once per step K (0-based) from the last stage's rank with
  dp_rank 0 and tp_rank 0. X is ``repr`` of the global-batch mean loss (a
  Python float, full precision). The loss reaches every rank (all_reduce SUM
  over DP on the last stage, divided by DP, then broadcast over the pipeline
  group) after ``optimizer.step()``.
- with ``--print-splits``, on every rank that dispatches tokens:
  ``splits step K micro M layer L rank R send [..] recv [..]``: the
  all_to_all_single input and output split sizes (in tokens) of the dispatch.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

PROG = "gpt.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --dp)")
    p.add_argument("--experts", "--moe-experts", dest="experts", type=int, default=0,
                   help="experts per MoE layer; 0 (default) means dense MLPs")
    p.add_argument("--top-k", type=int, default=1, choices=(1, 2), help="experts per token")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step per DP rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--device", default="cpu",
                   help='"cpu" (default), "cuda" (cuda:LOCAL_RANK) or an explicit one such as "cuda:0"')
    p.add_argument("--print-splits", action="store_true",
                   help="print the MoE dispatch split sizes on every rank")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms, warn_only; the math "
                        "attention kernel, whose backward has no atomics; CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                        "unless set): two runs of one layout give bit-equal losses on a GPU")
    args = p.parse_args(argv)
    for name in ("tp", "pp", "dp", "ep", "layers", "hidden", "heads", "micro_batches",
                 "seq_len", "batch", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.experts < 0 or args.steps < 0:
        p.error(f"--experts and --steps must not be negative, got {args.experts} and {args.steps}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.heads % args.tp:
        p.error(f"--heads {args.heads} must be a multiple of --tp {args.tp} (heads are split across TP)")
    if args.layers < args.pp:
        p.error(f"--layers {args.layers} must be at least --pp {args.pp} (every stage needs a layer)")
    if args.dp % args.ep:
        p.error(f"--dp {args.dp} must be a multiple of --ep {args.ep} (EP groups live inside DP)")
    if args.ep > 1 and args.experts == 0:
        p.error(f"--ep {args.ep} needs MoE layers: pass --experts (a multiple of {args.ep})")
    if args.experts and args.experts % args.ep:
        p.error(f"--experts {args.experts} must be a multiple of --ep {args.ep}")
    if args.experts and args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    return args


# ---------------------------------------------------------------- layout, groups


@dataclass(frozen=True, slots=True)
class Layout:
    """Where this rank sits in the TP x DP x PP (x EP) grid."""

    tp: int
    dp: int
    pp: int
    ep: int
    rank: int

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's process groups; None where the group has one rank (no communication)."""

    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    pipeline: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None
    pipeline_ranks: tuple[int, ...]


def build_groups(lay: Layout, moe: bool) -> Groups:
    """Create every group on every rank in the documented order; keep this rank's."""
    mine: dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]] = {}

    def make(kind: str, ranks: list[int]) -> None:
        group = dist.new_group(ranks)
        if lay.rank in ranks:
            mine[kind] = (group, tuple(ranks))

    for p in range(lay.pp):
        for d in range(lay.dp):
            make("tp", [lay.rank_of(t, d, p) for t in range(lay.tp)])
    for p in range(lay.pp):
        for t in range(lay.tp):
            make("dp", [lay.rank_of(t, d, p) for d in range(lay.dp)])
    for d in range(lay.dp):
        for t in range(lay.tp):
            make("pipeline", [lay.rank_of(t, d, p) for p in range(lay.pp)])
    if moe:
        for p in range(lay.pp):
            for t in range(lay.tp):
                for block in range(lay.dp // lay.ep):
                    make("ep", [lay.rank_of(t, block * lay.ep + e, p) for e in range(lay.ep)])
        for p in range(lay.pp):
            for t in range(lay.tp):
                for e in range(lay.ep):
                    make("expert_dp", [lay.rank_of(t, e + lay.ep * k, p) for k in range(lay.dp // lay.ep)])

    def get(kind: str) -> dist.ProcessGroup | None:
        if kind not in mine or len(mine[kind][1]) == 1:
            return None
        return mine[kind][0]

    return Groups(tp=get("tp"), dp=get("dp"), pipeline=get("pipeline"), ep=get("ep"),
                  expert_dp=get("expert_dp"), pipeline_ranks=mine["pipeline"][1])


# ------------------------------------------------------- communication autograd


class _CopyToTP(torch.autograd.Function):
    """Identity in forward; all-reduce of the input gradient over TP in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over TP in forward (sums row-parallel partials); identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over rows with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def copy_to_tp(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


# ----------------------------------------------------------------------- model


def _full_init(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The unsharded weight ``name``: the same on every rank and in every layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(shape, generator=gen) * std


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone())


class Attention(nn.Module):
    def __init__(self, a: argparse.Namespace, layer: int, tp_rank: int, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.heads = a.heads // a.tp
        self.head_dim = a.hidden // a.heads
        own = slice(tp_rank * self.heads, (tp_rank + 1) * self.heads)
        qkv = _full_init(a.seed, f"layers.{layer}.attn.qkv", (3, a.heads, self.head_dim, a.hidden), 0.02)
        out = _full_init(a.seed, f"layers.{layer}.attn.out", (a.hidden, a.heads, self.head_dim),
                         0.02 / (2 * a.layers) ** 0.5)
        self.qkv = _param(qkv[:, own].reshape(-1, a.hidden))
        self.out = _param(out[:, own].reshape(a.hidden, -1))

    def forward(self, x):
        b, s, _ = x.shape
        qkv = F.linear(copy_to_tp(x, self.tp_group), self.qkv)
        q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if torch.are_deterministic_algorithms_enabled():
            # The fused kernels' backward accumulates dq with atomics; the math one does not.
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return reduce_from_tp(F.linear(y, self.out), self.tp_group)


class MLP(nn.Module):
    def __init__(self, a: argparse.Namespace, layer: int, tp_rank: int, tp_group):
        super().__init__()
        self.tp_group = tp_group
        ffn = 4 * a.hidden // a.tp
        own = slice(tp_rank * ffn, (tp_rank + 1) * ffn)
        up = _full_init(a.seed, f"layers.{layer}.mlp.up", (4 * a.hidden, a.hidden), 0.02)
        down = _full_init(a.seed, f"layers.{layer}.mlp.down", (a.hidden, 4 * a.hidden),
                          0.02 / (2 * a.layers) ** 0.5)
        self.up = _param(up[own])
        self.down = _param(down[:, own])

    def forward(self, x):
        h = F.gelu(F.linear(copy_to_tp(x, self.tp_group), self.up))
        return reduce_from_tp(F.linear(h, self.down), self.tp_group)


class MoE(nn.Module):
    """Dropless top-k MoE; this rank holds experts ``[ep_rank*X/EP, (ep_rank+1)*X/EP)``,
    each with its hidden size split across TP."""

    def __init__(self, a: argparse.Namespace, layer: int, lay: Layout, groups: Groups):
        super().__init__()
        self.layer, self.top_k, self.experts = layer, a.top_k, a.experts
        self.ep, self.local = a.ep, a.experts // a.ep
        self.tp_group, self.ep_group = groups.tp, groups.ep
        ffn = 4 * a.hidden // a.tp
        own_ffn = slice(lay.tp_rank * ffn, (lay.tp_rank + 1) * ffn)
        first = lay.ep_rank * self.local
        self.router = _param(_full_init(a.seed, f"layers.{layer}.moe.router", (a.experts, a.hidden), 0.02))
        ups, downs = [], []
        for e in range(first, first + self.local):
            up = _full_init(a.seed, f"layers.{layer}.moe.expert.{e}.up", (4 * a.hidden, a.hidden), 0.02)
            down = _full_init(a.seed, f"layers.{layer}.moe.expert.{e}.down", (a.hidden, 4 * a.hidden),
                              0.02 / (2 * a.layers) ** 0.5)
            ups.append(up[own_ffn])
            downs.append(down[:, own_ffn])
        self.up = _param(torch.stack(ups))
        self.down = _param(torch.stack(downs))
        self.on_splits = None  # set by the training loop under --print-splits

    def expert_parameters(self) -> list[nn.Parameter]:
        return [self.up, self.down]

    def forward(self, x):
        b, s, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        probs = F.softmax(F.linear(tokens, self.router), dim=-1)
        gate, expert = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        # The router sees the replicated input directly; only the expert path
        # is column-parallel, so only its input gradient is reduced over TP.
        sent = copy_to_tp(tokens, self.tp_group)[order // self.top_k]
        counts = torch.bincount(flat_expert, minlength=self.experts)
        if self.ep_group is None:
            received, recv_counts = sent, counts
        else:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
            send_splits = counts.view(self.ep, self.local).sum(dim=1).tolist()
            recv_splits = recv_counts.view(self.ep, self.local).sum(dim=1).tolist()
            if self.on_splits is not None:
                self.on_splits(self.layer, send_splits, recv_splits)
            received = _AllToAll.apply(sent, recv_splits, send_splits, self.ep_group)
        # Received rows come grouped by source rank, then by expert.
        local_expert = torch.arange(self.local, device=x.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(local_expert, recv_counts)
        by_expert = torch.argsort(row_expert, stable=True)
        sizes = torch.bincount(row_expert, minlength=self.local).tolist()
        chunks = received[by_expert].split(sizes)
        outs = [F.linear(F.gelu(F.linear(c, self.up[e])), self.down[e]) for e, c in enumerate(chunks)]
        processed = torch.cat(outs)[torch.argsort(by_expert)]
        if self.ep_group is not None:
            processed = _AllToAll.apply(processed, send_splits, recv_splits, self.ep_group)
        expert_out = reduce_from_tp(processed, self.tp_group)[torch.argsort(order)]
        out = (expert_out.view(-1, self.top_k, hidden) * gate.unsqueeze(-1)).sum(dim=1)
        return out.view(b, s, hidden)


class Block(nn.Module):
    def __init__(self, a: argparse.Namespace, layer: int, lay: Layout, groups: Groups):
        super().__init__()
        self.ln1 = nn.LayerNorm(a.hidden)
        self.attn = Attention(a, layer, lay.tp_rank, groups.tp)
        self.ln2 = nn.LayerNorm(a.hidden)
        self.mlp = MoE(a, layer, lay, groups) if a.experts else MLP(a, layer, lay.tp_rank, groups.tp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """The layers of one pipeline stage (plus embeddings on the first, head on the last)."""

    def __init__(self, a: argparse.Namespace, lay: Layout, groups: Groups):
        super().__init__()
        self.first, self.last = lay.pp_rank == 0, lay.pp_rank == lay.pp - 1
        lo, hi = lay.pp_rank * a.layers // lay.pp, (lay.pp_rank + 1) * a.layers // lay.pp
        self.blocks = nn.ModuleList(Block(a, i, lay, groups) for i in range(lo, hi))
        if self.first:
            self.tok = _param(_full_init(a.seed, "embed.tokens", (a.vocab, a.hidden), 0.02))
            self.pos = _param(_full_init(a.seed, "embed.positions", (a.seq_len, a.hidden), 0.02))
        if self.last:
            self.ln_f = nn.LayerNorm(a.hidden)
            self.head = _param(_full_init(a.seed, "head", (a.vocab, a.hidden), 0.02))

    def forward(self, x):
        if self.first:
            x = F.embedding(x, self.tok) + self.pos
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = F.linear(self.ln_f(x), self.head)
        return x

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoE)]


# ------------------------------------------------------------------------ data


def global_batch(a: argparse.Namespace, step: int) -> torch.Tensor:
    """Step ``step``'s ``[DP*M*B, seq_len+1]`` token sequences, the same in every layout."""
    n = a.dp * a.micro_batches * a.batch
    gen = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}/data/{step}".encode()))
    start = torch.randint(0, a.vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    return (start + stride * torch.arange(a.seq_len + 1)) % a.vocab


# -------------------------------------------------------------------- pipeline


class Pipeline:
    """1F1B over this stage's micro-batches; p2p inside the pipeline group."""

    def __init__(self, lay: Layout, groups: Groups, act_shape: tuple[int, ...], device):
        self.lay, self.group, self.device = lay, groups.pipeline, device
        self.act_shape = act_shape
        ranks = groups.pipeline_ranks
        p = lay.pp_rank
        self.prev = ranks[p - 1] if p > 0 else None
        self.next = ranks[p + 1] if p < lay.pp - 1 else None

    def _exchange(self, send: torch.Tensor | None, send_to, recv_from) -> torch.Tensor | None:
        """Post a send and/or a receive and wait for both. Even stages post the send
        first and odd stages the receive, so neighbours never both wait to send."""
        buf = None
        ops = []
        if send is not None and send_to is not None:
            ops.append(lambda: dist.isend(send.detach().contiguous(), send_to, group=self.group))
        if recv_from is not None:
            buf = torch.empty(self.act_shape, device=self.device)
            ops.append(lambda: dist.irecv(buf, recv_from, group=self.group))
        if self.lay.pp_rank % 2:
            ops.reverse()
        for work in [op() for op in ops]:
            work.wait()
        return buf

    def run(self, stage: Stage, micro: list[tuple[torch.Tensor, torch.Tensor]], on_micro) -> float:
        """Forward and backward every micro-batch; returns the summed loss (last stage) or 0."""
        m = len(micro)
        warmup = min(self.lay.pp - self.lay.pp_rank - 1, m)
        inputs: list = []
        outputs: list = []
        loss_sum = 0.0
        done_fwd = 0

        def forward(x):
            nonlocal loss_sum, done_fwd
            tokens, targets = micro[done_fwd]
            on_micro(done_fwd)
            done_fwd += 1
            if x is None:
                x = tokens
            else:
                x.requires_grad_(True)
            y = stage(x)
            if stage.last:
                y = F.cross_entropy(y.flatten(0, 1), targets.flatten()) / m
                loss_sum += y.item()
            inputs.append(x)
            outputs.append(y)
            return None if stage.last else y

        def backward(dy):
            x, y = inputs.pop(0), outputs.pop(0)
            if stage.last:
                y.backward()
            else:
                y.backward(dy)
            return None if stage.first else x.grad

        x = None
        for _ in range(warmup):
            x = self._exchange(None, None, self.prev)
            self._exchange(forward(x), self.next, None)
        remaining = m - warmup
        if remaining:
            x = self._exchange(None, None, self.prev)
        for i in range(remaining):
            dy = self._exchange(forward(x), self.next, self.next)
            dx = backward(dy)
            last = i == remaining - 1
            x = self._exchange(dx, self.prev, None if last else self.prev)
        for _ in range(warmup):
            dy = self._exchange(None, None, self.next)
            self._exchange(backward(dy), self.prev, None)
        return loss_sum


# ------------------------------------------------------------------------ main


def _reduce_grads(params: list[nn.Parameter], group, divisor: int) -> None:
    """Sum the gradients over ``group`` (one flat all_reduce) and divide by ``divisor``."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def _init_distributed(a: argparse.Namespace) -> tuple[Layout, torch.device]:
    want = a.tp * a.pp * a.dp
    if "WORLD_SIZE" not in os.environ:
        if want != 1:
            sys.exit(f"{PROG}: WORLD_SIZE is not set but --tp {a.tp} x --pp {a.pp} x --dp {a.dp} = {want} "
                     f"ranks are needed; launch with torchrun --nproc-per-node {want} (or a launcher that "
                     f"sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)")
        # A world of one needs no launcher: provide what torchrun would.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = int(os.environ["WORLD_SIZE"])
    if world != want:
        sys.exit(f"{PROG}: WORLD_SIZE={world} but --tp {a.tp} x --pp {a.pp} x --dp {a.dp} = {want}; "
                 f"launch {want} ranks or change the parallel sizes so their product is {world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if a.device == "cuda" else a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{PROG}: --device {a.device} but this process (RANK={os.environ.get('RANK')}) sees no "
                 f"CUDA device; use --device cpu or check CUDA_VISIBLE_DEVICES")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if torch.cuda.is_available() and device.type == "cuda" else "gloo")
    return Layout(tp=a.tp, dp=a.dp, pp=a.pp, ep=a.ep, rank=dist.get_rank()), device


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
    lay, device = _init_distributed(a)
    groups = build_groups(lay, moe=a.experts > 0)
    stage = Stage(a, lay, groups).to(device)
    expert_params = [p for moe in stage.moe_layers() for p in moe.expert_parameters()]
    expert_ids = {id(p) for p in expert_params}
    dense_params = [p for p in stage.parameters() if id(p) not in expert_ids]
    if a.optimizer == "adamw":
        optimizer = torch.optim.AdamW(stage.parameters(), lr=a.lr)
    else:
        optimizer = torch.optim.SGD(stage.parameters(), lr=a.lr)
    pipeline = Pipeline(lay, groups, (a.batch, a.seq_len, a.hidden), device)
    reports = lay.pp_rank == lay.pp - 1 and lay.dp_rank == 0 and lay.tp_rank == 0
    share = a.micro_batches * a.batch

    for step in range(a.steps):
        where = {"micro": 0}
        if a.print_splits:
            def show(layer, send, recv, step=step):
                print(f"splits step {step} micro {where['micro']} layer {layer} rank {lay.rank} "
                      f"send {send} recv {recv}", flush=True)
            for moe in stage.moe_layers():
                moe.on_splits = show

        def on_micro(i):
            where["micro"] = i

        rows = global_batch(a, step)[lay.dp_rank * share:(lay.dp_rank + 1) * share].to(device)
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(a.batch)]
        optimizer.zero_grad(set_to_none=True)
        loss = pipeline.run(stage, micro, on_micro)
        _reduce_grads(dense_params, groups.dp, a.dp)
        _reduce_grads(expert_params, groups.expert_dp, a.dp)
        optimizer.step()

        # Every rank learns the global-batch loss: DP average on the last stage,
        # then a broadcast from the last stage down its pipeline.
        loss_t = torch.tensor([loss], dtype=torch.float64, device=device)
        if stage.last and groups.dp is not None:
            dist.all_reduce(loss_t, group=groups.dp)
            loss_t /= a.dp
        if groups.pipeline is not None:
            dist.broadcast(loss_t, src=groups.pipeline_ranks[-1], group=groups.pipeline)
        if reports:
            print(f"step {step} loss {loss_t.item()!r}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
