"""Train a small GPT on 2 (or more) processes with ringlet: the README's main job.

The model learns to write Python: by default it reads the Python standard library's own
source files (every machine has them), byte by byte; ``--data FILE`` trains on your text.
Pick how the work is spread over the ranks with ``--strategy``:

    ddp       DistributedDataParallel: a full replica per rank, gradients all-reduced
    fsdp      fully_shard: parameters, gradients and optimizer state sharded over the ranks
    hsdp      fully_shard over a 2-d mesh: sharded within groups, replicated across them
    tp        tensor parallelism: every block's matrices split over the ranks
    fsdp+tp   2-d: tensor parallel inside, fully_shard across
    ddp+tp    2-d: tensor parallel inside, DDP across

Run it (2 processes on this machine, over shared memory; no server to install)::

    ringlet-run --nproc-per-node 2 examples/train_gpt.py
    ringlet-run --nproc-per-node 2 examples/train_gpt.py --strategy fsdp --steps 300
    ringlet-run --nproc-per-node 2 examples/train_gpt.py --resume        # continue the last run

Rank 0 shows progress, a per-rank time breakdown every ``--breakdown-every`` steps, and at the
end a summary, a sample of generated text, ``metrics.json`` and a loss plot in ``--out``.
The same ``--seed`` gives the same losses under every strategy (up to float rounding).
See docs/getting_started.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from gpt.strategies import STRATEGIES
from gpt.trainer import TrainConfig, train

import ringlet.distributed as dist


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--strategy", choices=STRATEGIES, default=d.strategy)
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel degree for fsdp+tp/ddp+tp (default 2)")
    ap.add_argument("--replicate", type=int, default=None, help="HSDP replica groups (default 2)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size,
                    help="sequences per step, all ranks")
    ap.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    ap.add_argument("--block-size", type=int, default=d.block_size, help="context length (bytes)")
    ap.add_argument("--n-layer", type=int, default=d.n_layer)
    ap.add_argument("--n-head", type=int, default=d.n_head)
    ap.add_argument("--n-embd", type=int, default=d.n_embd)
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps")
    ap.add_argument("--grad-clip", type=float, default=d.grad_clip,
                    help="clip the gradient norm to this (0: off; not with tensor parallelism)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--bf16", action="store_true", help="compute in bfloat16 (weights stay fp32)")
    ap.add_argument("--data", default=None,
                    help="a text file to train on (default: Python's stdlib)")
    ap.add_argument("--data-bytes", type=int, default=d.data_bytes,
                    help="read at most this many bytes")
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
    ap.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    ap.add_argument("--out", default=d.out, help="checkpoints, metrics.json and the plot")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in --out")
    ap.add_argument("--sample-tokens", type=int, default=d.sample_tokens,
                    help="bytes to generate at the end")
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--breakdown-every", type=int, default=d.breakdown_every)
    ap.add_argument("--progress", choices=("auto", "bar", "lines", "off"), default=d.progress,
                    help="auto: a bar on a terminal, plain lines otherwise")
    ap.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    return TrainConfig(**vars(ap.parse_args(argv)))


def main() -> int:
    cfg = parse_args()
    torch.set_num_threads(1)           # one core per rank: ranks share this machine's cores
    with tempfile.TemporaryDirectory() as tmp:
        if "RANK" in os.environ:
            # env:// from ringlet-run (or torchrun); shm between local ranks
            dist.init_process_group()
        else:                          # plain `python train_gpt.py`: a world of one process
            print("train_gpt: not started by ringlet-run: training on 1 process "
                  "(ringlet-run --nproc-per-node 2 examples/train_gpt.py for 2)", flush=True)
            dist.init_process_group(init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            train(cfg)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
