"""GPU check (run by hand on a CUDA machine): CUDA tensors through ringlet's public API reach torch's
NCCL engine, CPU tensors torch's gloo, with backend "cpu:torch:gloo,cuda:torch:nccl" (1 rank).

    PYTHONPATH=. python scripts/gpu_check.py
"""

import torch

import ringlet.distributed as dist

if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: nothing to check")
dist.init_process_group("cpu:torch:gloo,cuda:torch:nccl", init_method="tcp://127.0.0.1:0", rank=0,
                        world_size=1)
g = torch.arange(6, dtype=torch.float32, device="cuda")
dist.all_reduce(g)
c = torch.arange(6, dtype=torch.float32)
dist.all_reduce(c)
out = torch.empty(6, device="cuda")
dist.all_gather_into_tensor(out, g)
lst = [torch.empty(6, device="cuda")]
dist.all_gather(lst, g)
dist.broadcast(g, src=0)
w = dist.all_reduce(g, async_op=True)
w.wait()
torch.cuda.synchronize()
ok = torch.equal(g.cpu(), c) and torch.equal(out.cpu(), c) and torch.equal(lst[0].cpu(), c)
print("backend", dist.get_backend(), "cuda all_reduce/all_gather/broadcast ok:", ok)
dist.destroy_process_group()
raise SystemExit(0 if ok else 1)
