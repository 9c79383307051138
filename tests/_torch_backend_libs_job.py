"""A training job written for torch.distributed libraries, unchanged but for the backend's name:
Lightning Fabric (``DDPStrategy(process_group_backend=NAME)``: Fabric creates the process group)
then Hugging Face accelerate (an ``Accelerator`` on CPU uses the group already there).  Launched
by tests/test_torch_backend_libs.py under torchrun with NAME = gloo and NAME = ringlet; prints
each library's losses."""

import json
import sys

import torch

import ringlet  # noqa: F401  (registers "ringlet"; harmless for gloo)

BACKEND = sys.argv[1]


def data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def with_fabric() -> list[float]:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=DDPStrategy(process_group_backend=BACKEND))
    fabric.launch()
    net, opt = fabric.setup(model(), torch.optim.SGD(model().parameters(), lr=0.1))
    losses = []
    for x, y in data(fabric.global_rank):
        loss = torch.nn.functional.mse_loss(net(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(round(float(fabric.all_reduce(loss.detach(), reduce_op="mean")), 6))
    return losses


def with_accelerate() -> list[float]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = acc.prepare(net, opt)
    losses = []
    for x, y in data(acc.process_index):
        loss = torch.nn.functional.mse_loss(net(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(round(float(acc.reduce(loss.detach(), reduction="mean")), 6))
    return losses


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    fabric_losses = with_fabric()
    accelerate_losses = with_accelerate()
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "group": type(dist.group.WORLD).__name__,
                                  "fabric": fabric_losses, "accelerate": accelerate_losses}),
          flush=True)
    dist.destroy_process_group()
