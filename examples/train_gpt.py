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
    ringlet-run --nproc-per-node 3 --restart-policy replica --max-restarts 2 \
        examples/train_gpt.py --fault-tolerant --kill-random   # a replica dies and rejoins

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
from gpt import fault_tolerant
from gpt.resume import RunRefused, Stopped, stop_on_sigterm
from gpt.strategies import STRATEGIES
from gpt.trainer import TrainConfig, train

import ringlet.distributed as dist


class _Help(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default or
    the default is no value (None, or the off state of an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool)):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per field of ``TrainConfig`` (docs/getting_started.md)."""
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    add = ap.add_argument
    add("--strategy", choices=STRATEGIES, default=d.strategy,
        help="how the model is spread over the ranks (docs/strategies.md)")
    add("--tp", type=int, default=None, help="tensor-parallel degree of fsdp+tp and ddp+tp "
        "(default: 2 on an even number of ranks, else 1)")
    add("--replicate", type=int, default=None, help="hsdp: number of replica groups "
        "(default: 2 on an even number of ranks, else 1)")
    add("--steps", type=int, default=d.steps,
        help="optimizer steps in total, a resumed run's earlier steps included")
    add("--batch-size", type=int, default=d.batch_size, help="sequences per step, all ranks")
    add("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per step")
    add("--block-size", type=int, default=d.block_size, help="context length in bytes")
    add("--n-layer", type=int, default=d.n_layer, help="transformer blocks")
    add("--n-head", type=int, default=d.n_head, help="attention heads per block")
    add("--n-embd", type=int, default=d.n_embd, help="model width")
    add("--lr", type=float, default=d.lr, help="peak learning rate of AdamW")
    add("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then cosine")
    add("--grad-clip", type=float, default=d.grad_clip,
        help="clip the gradient norm to this, 0: off (ddp, fsdp, hsdp only)")
    add("--seed", type=int, default=d.seed, help="initial weights and batches")
    add("--bf16", action="store_true", help="compute in bfloat16, weights stay fp32 "
        "(default: fp32)")
    add("--data", default=None, metavar="FILE",
        help="a text file to train on (default: Python's standard library)")
    add("--data-bytes", type=int, default=d.data_bytes, help="read at most this many bytes")
    add("--eval-every", type=int, default=d.eval_every, help="steps between validations")
    add("--eval-batches", type=int, default=d.eval_batches, help="batches per validation")
    add("--checkpoint-every", type=int, default=d.checkpoint_every,
        help="steps between checkpoints (and one at the last step)")
    add("--out", default=d.out, help="where checkpoints, metrics.json and the plot go")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --out; "
        "without one, start from step 0 (default: off; a checkpoint in --out is then refused)")
    add("--sample-tokens", type=int, default=d.sample_tokens,
        help="bytes to generate at the end, 0: none")
    add("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    add("--breakdown-every", type=int, default=d.breakdown_every,
        help="steps between per-rank time reports")
    add("--progress", choices=("auto", "bar", "lines", "off"), default=d.progress,
        help="auto: a bar on a terminal, plain lines otherwise")
    add("--no-plot", dest="plot", action="store_false",
        help="skip the PNG (default: write it if matplotlib is installed)")
    add("--fault-tolerant", action="store_true", help="ddp/hsdp: a failed replica drops out, "
        "the others go on, it rejoins by healing (launch with ringlet-run --restart-policy "
        "replica; docs/getting_started.md)")
    add("--kill-random", action="store_true", help="with --fault-tolerant: one replica (from "
        "--seed) SIGKILLs itself once, between 1/4 and 1/2 of --steps")
    add("--rejoin-wait", type=float, default=d.rejoin_wait, help="with --fault-tolerant: "
        "seconds the replicas wait at the end for a restarted one to rejoin")
    return ap


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """``TrainConfig`` from the command line (``sys.argv[1:]`` when ``argv`` is None)."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))


def main() -> int:
    """Run on the ranks ``ringlet-run`` started (or alone); 2: refused, 128+n: stopped by a
    signal, 130: ctrl-c."""
    cfg = parse_args()
    torch.set_num_threads(1)           # one core per rank: ranks share this machine's cores
    stop_on_sigterm()                  # ringlet-run passes ctrl-c on to its workers as SIGTERM
    if cfg.fault_tolerant or cfg.kill_random:     # each replica's processes form their own world
        try:
            return fault_tolerant.main(cfg)
        except Stopped as stopped:
            return 128 + stopped.signum
        except KeyboardInterrupt:
            return 130
    with tempfile.TemporaryDirectory() as tmp:
        if "RANK" in os.environ:
            # env:// from ringlet-run (or torchrun); shm between local ranks
            dist.init_process_group()
        else:                          # plain `python train_gpt.py`: a world of one process
            print("train_gpt: not started by ringlet-run: training on 1 process "
                  "(ringlet-run --nproc-per-node 2 examples/train_gpt.py for 2)", flush=True)
            dist.init_process_group(init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            train(cfg, sys.argv)
        except RunRefused as refused:
            if dist.get_rank() == 0:
                print(f"train_gpt: error: {refused}", file=sys.stderr, flush=True)
            return 2
        except Stopped as stopped:     # rank 0 has said where the last checkpoint is
            return 128 + stopped.signum
        except KeyboardInterrupt:
            return 130
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
