"""Plans, training loops and rank bodies shared by the tensor-parallel tests (module level: they
pickle).

A rank body builds the reference model (seeded, private generator), parallelizes a deep
copy, trains both on the same batches and reports what the tests compare: losses per
step, the largest gradient and parameter differences (DTensors gathered with
``full_tensor``) and the collectives counted by ``CommDebugMode`` per phase.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _tp_models import Llama, init_
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def llama_plan(sp: bool) -> dict[str, Any]:
    """torchtitan's Llama plan: with ``sp``, sequence-parallel norms and a vocab-sharded head."""
    seq = Shard(1) if sp else Replicate()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel() if sp else None,
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel() if sp else None,
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "norm": SequenceParallel() if sp else None,
        "output": ColwiseParallel(input_layouts=seq,
                                  output_layouts=Shard(-1) if sp else Replicate(),
                                  use_local_output=not sp),
    }


def parallelize_llama(model: nn.Module, mesh: Any, sp: bool) -> nn.Module:
    return parallelize_module(model, mesh,
                              {k: v for k, v in llama_plan(sp).items() if v is not None})


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(ours: nn.Module, ref: nn.Module, grads: bool) -> float:
    pairs = zip(ours.parameters(), ref.parameters())
    return max(float((full(p.grad if grads else p) - (q.grad if grads else q)).detach().abs().max())
               for p, q in pairs)


def train_pair(model: nn.Module, ref: nn.Module, batches: list[Any],
               loss_fn: Callable[..., torch.Tensor],
               foreach: bool,
               loss_ctx: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """AdamW steps on both models (with ``foreach``, after ``clip_grad_norm_``); the first step's
    collectives and gradients are recorded."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for step, batch in enumerate(batches):
        with CommDebugMode() as fwd:
            pred = model(batch[0])
        with loss_ctx():
            with CommDebugMode() as loss_comm:
                loss = loss_fn(pred, batch[1])
            with CommDebugMode() as bwd:
                loss.backward()
        ref_loss = loss_fn(ref(batch[0]), batch[1])
        ref_loss.backward()
        out["losses"].append(float(full(loss).detach()))
        out["ref_losses"].append(float(ref_loss.detach()))
        if step == 0:
            out["comms"] = (fwd.get_comm_counts(), loss_comm.get_comm_counts(),
                            bwd.get_comm_counts())
            out["grad_diff"] = max_diff(model, ref, grads=True)
        if foreach:         # every parameter a DTensor: clip the global norm (one all-reduce)
            with CommDebugMode() as clip:
                norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            out.setdefault("norms", []).append((float(full(norm)), float(ref_norm),
                                                clip.get_comm_counts()))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    out["param_diff"] = max_diff(model, ref, grads=False)
    return out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_batches(steps: int, vocab: int = 32, seq: int = 8, batch: int = 2,
                  seed: int = 3) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in toks]


def placed(device_type: str, batches: list[Any]) -> tuple[nn.Module, list[Any]]:
    """The reference Llama and ``batches``, on the current CUDA device for ``"cuda"``."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    return init_(Llama()).to(dev), [(x.to(dev), y.to(dev)) for x, y in batches]


def llama_parity(rank: int, n: int, sp: bool, steps: int = 10,
                 device_type: str = "cpu") -> dict[str, Any]:
    """TP (or TP + sequence parallel + loss_parallel) Llama on ``n`` ranks vs the same model on
    one; with ``device_type="cuda"`` both on the current CUDA device."""
    mesh = init_device_mesh(device_type, (n,), mesh_dim_names=("tp",))
    ref, batches = placed(device_type, token_batches(steps))
    model = parallelize_llama(copy.deepcopy(ref), mesh, sp)
    # all parameters are DTensors only with sp (the norms stay plain otherwise): foreach needs one
    # kind
    return train_pair(model, ref, batches, lm_loss, foreach=sp,
                      loss_ctx=loss_parallel if sp else contextlib.nullcontext)


def torch_tp_losses(tmp: str, rank: int, n: int, steps: int) -> list[float]:
    """The same training with torch's tensor parallelism on gloo (the oracle)."""
    import torch.distributed as tdist
    import torch.distributed.tensor.parallel as ttp
    from torch.distributed.device_mesh import init_device_mesh as t_init
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'gloo')}", rank=rank,
                             world_size=n)
    try:
        mesh = t_init("cpu", (n,))
        seq = TS(1)
        plan: dict[str, Any] = {
            "tok_embeddings": ttp.RowwiseParallel(input_layouts=TR(), output_layouts=seq),
            "norm": ttp.SequenceParallel(),
            "output": ttp.ColwiseParallel(input_layouts=seq, output_layouts=TS(-1),
                                          use_local_output=False)}
        for layer in ("attention", "feed_forward"):
            inputs = (seq, None, None) if layer == "attention" else (seq,)
            wanted = (TR(), None, None) if layer == "attention" else (TR(),)
            plan[f"layers.*.{layer}"] = (ttp.PrepareModuleInput(
                input_layouts=inputs, desired_input_layouts=wanted))
        plan["layers.*.attention_norm"] = ttp.SequenceParallel()
        plan["layers.*.ffn_norm"] = ttp.SequenceParallel()
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                     "feed_forward.w3"):
            plan[f"layers.*.{name}"] = ttp.ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.*.{name}"] = ttp.RowwiseParallel(output_layouts=seq)
        model = ttp.parallelize_module(init_(Llama()), mesh, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        losses = []
        for x, y in token_batches(steps):
            with ttp.loss_parallel():
                loss = lm_loss(model(x), y)
                loss.backward()
            losses.append(float(loss.full_tensor().detach()))
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return losses
    finally:
        tdist.destroy_process_group()


def llama_vs_torch(rank: int, n: int, tmp: str, steps: int = 5) -> dict[str, Any]:
    """Real processes: ringlet TP+SP over shm next to torch TP+SP over gloo, same model and
    batches."""
    ours = llama_parity(rank, n, sp=True, steps=steps)
    return {"ours": ours["losses"], "ref": ours["ref_losses"],
            "torch": torch_tp_losses(tmp, rank, n, steps), "param_diff": ours["param_diff"]}


def llama_2d(rank: int, n: int, strategy: str, steps: int = 5,
             device_type: str = "cpu") -> dict[str, Any]:
    """TP + sequence parallel on "tp", then DDP or fully_shard on "dp" (2 x 2), vs one process.

    Each dp rank trains on its half of every batch; the reference trains the same model on
    the whole batch (the mean loss over the batch is the mean of the dp ranks' means).
    """
    from ringlet.distributed.fsdp import fully_shard
    from ringlet.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh(device_type, (2, n // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    ref, batches = placed(device_type, token_batches(steps, batch=4))
    model = parallelize_llama(copy.deepcopy(ref), mesh["tp"], sp=True)
    if strategy == "ddp":
        model = DistributedDataParallel(model, device_mesh=mesh["dp"])
    else:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for x, y in batches:
        half = slice(2 * dp, 2 * dp + 2)
        with loss_parallel():
            loss = lm_loss(model(x[half]), y[half])
            loss.backward()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        out["losses"].append(float(full(loss).detach()))
        out["ref_losses"].append(float(ref_loss.detach()))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    sd = (model.module if strategy == "ddp" else model).state_dict()
    out["param_diff"] = max(float((full(sd[k]) - v).abs().max())
                            for k, v in ref.state_dict().items())
    out["placements"] = sorted({"".join(map(str, v.placements)) for v in sd.values()
                                if isinstance(v, DTensor)})
    return out
