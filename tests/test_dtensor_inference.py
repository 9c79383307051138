"""DTensor under ``torch.inference_mode()`` and ``torch.no_grad()``: composite ops that arrive
whole (``linear``, ``matmul``, ``layer_norm``, ``softmax``, attention...) and views of normal
tensors ([Note: composite ops] in ``ringlet/dtensor/_decide.py``), against plain tensors; and
a tensor-parallel Llama under both against the same model in one process (rank threads)."""

from __future__ import annotations

import copy

import _tp_workers as TPW
import pytest
import torch
import torch.nn.functional as F
from _tp_models import Llama, init_

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ringlet.testing import run_threads

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)


def _t(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _cases() -> dict[str, tuple[object, list[tuple[torch.Tensor, list[object]]]]]:
    """name -> (function, [(plain operand, its placements)...])."""
    x, w, b, vec = _t(0, 2, 4, 8), _t(1, 6, 8), _t(2, 6), _t(3, 8)
    q = _t(4, 2, 4, 3, 8)
    idx = torch.tensor([[1, 3, 5], [0, 2, 9]])
    return {
        "linear colwise": (F.linear, [(x, [R]), (w, [S0]), (b, [S0])]),
        "linear rowwise": (F.linear, [(x, [S2]), (w, [S1])]),
        "linear batch": (F.linear, [(x, [S0]), (w, [R]), (b, [R])]),
        "matmul": (torch.matmul, [(x, [S1]), (w.t().contiguous(), [R])]),
        "matmul colwise": (torch.matmul, [(x, [R]), (w.t().contiguous(), [S1])]),
        "addmm": (torch.addmm, [(b, [S0]), (x[0], [R]), (w.t().contiguous(), [S1])]),
        "layer_norm": (lambda t, g, h: F.layer_norm(t, (8,), g, h), [(x, [S1]), (vec, [R]),
                                                                     (vec, [R])]),
        "rms_norm": (lambda t, g: F.rms_norm(t, (8,), g), [(x, [S0]), (vec, [R])]),
        "silu": (F.silu, [(x, [S2])]),
        "gelu tanh": (lambda t: F.gelu(t, approximate="tanh"), [(x, [S1])]),
        "softmax": (lambda t: F.softmax(t, -1), [(x, [S0])]),
        "log_softmax": (lambda t: F.log_softmax(t, 1), [(x, [S2])]),
        "sdpa": (lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), [(q, [S0])]),
        "embedding": (F.embedding, [(idx, [R]), (_t(5, 10, 8), [S1])]),
        "dropout eval": (lambda t: F.dropout(t, 0.5, training=False), [(x, [S1])]),
        "einsum": (lambda a, c: torch.einsum("btd,ed->bte", a, c), [(x, [S0]), (w, [R])]),
        "views": (lambda t: t.t().unsqueeze(0).transpose(0, 1)[:, :, 1:], [(x[0], [S0])]),
    }


def _ops_under(rank: int, n: int, mode: str) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (n,))
    out: dict[str, object] = {}
    for name, (fn, operands) in _cases().items():
        dts = [distribute_tensor(t, mesh, pls) for t, pls in operands]
        for attempt in range(2):            # the uncached path, then the cached decisions
            with MODES[mode]():
                got = fn(*dts)              # type: ignore[operator]
                want = fn(*[t for t, _ in operands])  # type: ignore[operator]
            full = got.full_tensor() if isinstance(got, DTensor) else got
            ok = full.shape == want.shape and bool((full - want).abs().max() < 1e-5)
            # like a plain tensor: a view of a normal tensor is a normal tensor
            same_kind = name != "views" or got.is_inference() == want.is_inference()
            out[f"{name} #{attempt}"] = (ok and same_kind) or (full.tolist(), got.is_inference())
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_undecomposed_ops_match_plain_tensors(mode: str) -> None:
    for res in run_threads(_ops_under, 2, mode):
        assert all(v is True for v in res.values()), {k: v for k, v in res.items() if v is not True}


def _llama_without_grad(rank: int, n: int, sp: bool) -> list[float]:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = init_(Llama())
    model = TPW.parallelize_llama(copy.deepcopy(ref), mesh, sp)
    tokens = TPW.token_batches(1)[0][0]
    diffs = []
    for mode in MODES.values():
        for _ in range(2):
            with mode():
                got, want = model(tokens), ref(tokens)
            full = got.full_tensor() if isinstance(got, DTensor) else got
            diffs.append(float((full - want).abs().max()))
    return diffs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_llama_under_inference_mode_and_no_grad(sp: bool) -> None:
    for diffs in run_threads(_llama_without_grad, 2, sp):
        assert max(diffs) < 1e-5, diffs
