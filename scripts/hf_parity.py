"""Hugging Face Llama trained the same way under torch.distributed and under ringlet.

One worker body, two imports: with ``torch`` it uses torch.distributed (started by torchrun), with
``ringlet`` the same names from ringlet (started by ringlet-run), as a migrated script would.  A
small ``LlamaForCausalLM`` (2 layers, hidden 64) trains 5 AdamW steps under each strategy and
rank 0 prints the mean loss of every step; the driver compares the two lists.

Strategies: ``ddp`` and ``fsdp`` (every decoder layer and the root, clipping the global grad norm)
on 2 ranks, ``tp`` (q/k/v/gate/up column-wise, o/down row-wise) on 2 ranks, ``fsdp+tp`` on a
2 x 2 mesh (4 ranks).

Needs ``transformers`` (not a dependency of ringlet: ``pip install transformers``).  By hand:

    python scripts/hf_parity.py [--strategies ddp,fsdp,tp,fsdp+tp] [--timeout 300]

Exit status 0 when every strategy gives the same losses (within 1e-5) under both.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

STRATEGIES = {"ddp": 2, "fsdp": 2, "tp": 2, "fsdp+tp": 4}


def _imports(impl: str) -> dict:
    if impl == "torch":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        import ringlet.distributed as dist
        from ringlet.distributed.device_mesh import init_device_mesh
        from ringlet.distributed.fsdp import fully_shard
        from ringlet.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        from ringlet.nn.parallel import DistributedDataParallel as DDP
    return {"dist": dist, "mesh": init_device_mesh, "fully_shard": fully_shard,
            "col": ColwiseParallel, "row": RowwiseParallel, "parallelize": parallelize_module,
            "DDP": DDP}


def _tp_plan(m: dict, layers: int) -> dict:
    plan = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            plan[p + name] = m["col"]()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = m["row"]()
    return plan


def worker(impl: str, strategy: str) -> None:
    """One rank: build, wrap, train 5 steps, print the losses on rank 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = _imports(impl)
    dist = m["dist"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    dp_rank, dp_size = rank, world
    if strategy == "ddp":
        model = m["DDP"](model)
    elif strategy == "fsdp":
        for layer in model.model.layers:
            m["fully_shard"](layer)
        m["fully_shard"](model)
    else:
        if strategy == "tp":
            mesh = m["mesh"]("cpu", (world,), mesh_dim_names=("tp",))
            dp_rank, dp_size = 0, 1
        else:
            mesh = m["mesh"]("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
        m["parallelize"](model, mesh["tp"], _tp_plan(m, cfg.num_hidden_layers))
        if strategy == "fsdp+tp":
            for layer in model.model.layers:
                m["fully_shard"](layer, mesh=mesh["dp"])
            m["fully_shard"](model, mesh=mesh["dp"])
    backend = os.environ.get("HF_PARITY_COMPILE")
    forward = torch.compile(model, backend=backend) if backend else model
    # Plain and DTensor parameters mix under TP alone, which foreach kernels and the global norm
    # refuse (torch as ringlet): per-parameter AdamW there, no clipping.
    data_parallel = strategy in ("ddp", "fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=data_parallel)
    losses = []
    for step in range(5):
        ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(100 + step))
        per = 4 // dp_size
        local = ids[dp_rank * per:(dp_rank + 1) * per]
        loss = forward(input_ids=local, labels=local).loss
        loss.backward()
        if data_parallel:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if rank == 0:
        print("LOSSES " + " ".join(f"{x:.7f}" for x in losses), flush=True)
    dist.destroy_process_group()


def _run(impl: str, strategy: str, timeout: float,
         compile_backend: str | None = None) -> list[float] | str:
    n = STRATEGIES[strategy]
    launcher = ([sys.executable, "-m", "torch.distributed.run"] if impl == "torch"
                else [sys.executable, "-m", "ringlet.distributed.run"])
    with socket.socket() as sock:        # a free port: torchrun's default 29500 may be taken
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = launcher + ["--nproc-per-node", str(n), "--master-addr", "127.0.0.1", "--master-port",
                      str(port), __file__, "--worker", impl, strategy]
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if compile_backend:
            env["HF_PARITY_COMPILE"] = compile_backend
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    found = re.search(r"LOSSES ([-\d. ]+)", proc.stdout)
    if not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"exit {proc.returncode}: " + " | ".join(tail)
    if proc.returncode:
        # The losses are in; the job failed afterwards (torch's gloo sometimes aborts a rank in
        # its teardown: "terminate called without an active exception").  Say so, keep them.
        print(f"note: {impl} {strategy} exited {proc.returncode} after printing its losses")
    return [float(x) for x in found.group(1).split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--compile", metavar="BACKEND", default=None,
                    help="run the model's forward through torch.compile(backend=BACKEND) on both "
                         "stacks (e.g. inductor, aot_eager)")
    ap.add_argument("--worker", nargs=2, metavar=("IMPL", "STRATEGY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers): nothing checked")
        return 2
    print(f"transformers {transformers.__version__}"
          + (f", torch.compile(backend={args.compile!r})" if args.compile else ""))
    ok = True
    for strategy in args.strategies.split(","):
        if strategy not in STRATEGIES:
            ap.error(f"--strategies: expected names from {sorted(STRATEGIES)}, got {strategy!r}")
        ref = _run("torch", strategy, args.timeout, args.compile)
        got = _run("ringlet", strategy, args.timeout, args.compile)
        same = (isinstance(ref, list) and isinstance(got, list) and len(ref) == len(got)
                and all(abs(a - b) <= 1e-5 for a, b in zip(ref, got)))
        ok &= same
        print(f"{'PASS' if same else 'FAIL'}  {strategy:8} torch {ref}\n{'':16}ringlet {got}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
