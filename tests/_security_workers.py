"""The pickle gadget corpus of tests/test_security.py and the rank bodies that send it.

Each gadget, if it ran, would create the sentinel file.  An attacking rank bypasses ringlet's
encoder (``objects._encode`` is replaced in that process only) and sends the crafted payload;
the victim runs with ``RINGLET_SAFE_OBJECTS=1`` and must refuse it without running anything.
"""

from __future__ import annotations

import builtins
import copyreg
import functools
import io
import os
import pickle
import subprocess
from typing import Any

import numpy as np
import torch

import ringlet.distributed as dist
from ringlet.c10d import objects


class Touch:
    """Creates the file named by its argument when constructed (what a gadget wants to run)."""

    def __init__(self, path: str) -> None:
        open(path, "w").close()


class _Reduce:
    """An object whose pickle calls ``fn(*args)`` on the receiver."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


class _ReduceEx:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce_ex__(self, protocol: int) -> Any:
        return (os.system, (f"touch {self.path}",))


def _archive(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _RawPickleModule:
    """A stand-in pickle module for ``torch.save`` whose Pickler writes given bytes as data.pkl."""

    class Pickler:
        def __init__(self, f: Any, protocol: int = 2) -> None:
            self.f = f

        def dump(self, raw: bytes) -> None:
            self.f.write(raw)


def _archive_raw(pickle_bytes: bytes) -> bytes:
    """A torch.save archive whose data.pkl is exactly ``pickle_bytes``."""
    buf = io.BytesIO()
    torch.save(pickle_bytes, buf, pickle_module=_RawPickleModule)
    return buf.getvalue()


def _npy_with_pickle(path: str, sentinel: str) -> str:
    """A .npy file holding an object array whose unpickling creates the sentinel."""
    arr = np.empty(1, dtype=object)
    arr[0] = _Reduce(os.system, f"touch {sentinel}")
    np.save(path, arr, allow_pickle=True)
    return path


def _unsafe_torch_file(path: str, sentinel: str) -> str:
    torch.save(_Reduce(os.system, f"touch {sentinel}"), path)
    return path


def gadgets(sentinel: str, workdir: str) -> dict[str, tuple[bytes, str]]:
    """name -> (payload as a peer would send it, a callable or opcode the refusal must name)."""
    touch = f"touch {sentinel}"
    write = f"open({sentinel!r}, 'w').close()"
    unsafe_load = functools.partial(torch.load, weights_only=False)
    inner = _archive(_Reduce(os.system, touch))
    proto5 = b"\x80\x05" + b"\x97" + b"\x98" + b"."          # NEXT_BUFFER, READONLY_BUFFER
    proto5_gadget = (b"\x80\x05\x97" + b"\x8c\x05posix\x94\x8c\x06system\x94\x93\x94"
                     + b"\x8c" + bytes([len(touch)]) + touch.encode() + b"\x94\x85\x94R\x94.")
    inst = f"(S'{touch}'\nios\nsystem\n.".encode()           # protocol 0: INST names os.system
    corpus: dict[str, tuple[Any, str]] = {
        "os.system": (_Reduce(os.system, touch), "system"),
        "subprocess.call": (_Reduce(subprocess.call, ["touch", sentinel]), "subprocess.call"),
        "subprocess.Popen": (_Reduce(subprocess.Popen, ["touch", sentinel]), "subprocess.Popen"),
        "builtins.eval": (_Reduce(builtins.eval, write), "builtins.eval"),
        "builtins.exec": (_Reduce(builtins.exec, write), "builtins.exec"),
        "storage._load_from_bytes": (_Reduce(torch.storage._load_from_bytes, inner),
                                     "_load_from_bytes"),
        "torch.load(weights_only=False)": (
            _Reduce(unsafe_load, _unsafe_torch_file(os.path.join(workdir, "evil.pt"), sentinel)),
            "functools.partial"),
        "numpy.load": (
            _Reduce(np.load, _npy_with_pickle(os.path.join(workdir, "evil.npy"), sentinel),
                    None, True),
            "numpy"),
        "functools.partial chain": (
            _Reduce(functools.partial(functools.partial(os.system, touch))), "functools.partial"),
        "__reduce_ex__": (_ReduceEx(sentinel), "system"),
        "copyreg._reconstructor": (_Reduce(copyreg._reconstructor, Touch, Touch, sentinel),
                                   "copyreg"),
    }
    out = {name: (objects.SAFE_MAGIC + _archive(obj), must) for name, (obj, must) in corpus.items()}
    out["protocol-5 buffers"] = (objects.SAFE_MAGIC + _archive_raw(proto5), "NEXT_BUFFER")
    out["protocol-5 buffer then os.system"] = (objects.SAFE_MAGIC + _archive_raw(proto5_gadget),
                                               "system")
    out["protocol-0 INST"] = (objects.SAFE_MAGIC + _archive_raw(inst), "os.system")
    out["plain pickle header"] = (objects.MAGIC + pickle.dumps(_Reduce(os.system, touch)), "system")
    out["raw pickle in the restricted header"] = (
        objects.SAFE_MAGIC + pickle.dumps(_Reduce(os.system, touch), protocol=2), "system")
    return out


# -- rank bodies (run_world / run_threads) ---------------------------------------------------------
def _send_as_attacker(payload: bytes, op: str) -> Any:
    objects._encode = lambda obj: payload   # this process only: the attacker's own encoder
    return _run_op(op, "bait")


def _run_op(op: str, obj: Any) -> Any:
    n = dist.get_world_size()
    if op == "broadcast_object_list":
        objs = [obj]
        dist.broadcast_object_list(objs, src=0)
        return objs[0]
    if op == "all_gather_object":
        out: list[Any] = [None] * n
        dist.all_gather_object(out, obj)
        return out
    if op == "scatter_object_list":
        got: list[Any] = [None]
        dist.scatter_object_list(got, [obj] * n if dist.get_rank() == 0 else None, src=0)
        return got[0]
    if op == "send_object_list":
        if dist.get_rank() == 0:
            dist.send_object_list([obj], dst=1)
            return None
        got = [None]
        dist.recv_object_list(got, src=0)
        return got[0]
    raise ValueError(f"unknown op {op}")


def gadget_round(rank: int, n: int, names: list[str], sentinel: str, workdir: str,
                 op: str) -> list[str]:
    """Rank 0 sends each gadget in turn; the other ranks (restricted mode) report each refusal."""
    corpus = gadgets(sentinel, workdir)
    original = objects._encode
    outcomes = []
    for name in names:
        payload, _must = corpus[name]
        try:
            if rank == 0:
                _send_as_attacker(payload, op)
                outcomes.append("sent")
            else:
                got = _run_op(op, "victim")
                outcomes.append(f"ACCEPTED {got!r}")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
        finally:
            objects._encode = original
    return outcomes


def plain_data_round(rank: int, n: int) -> list[Any]:
    """Restricted mode still carries plain data and tensors."""
    obj = {"rank": rank, "t": torch.arange(3.0) + rank, "s": {1, 2}, "b": b"x", "c": 1 + 2j,
           "nested": [(1, "a"), None, True]}
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    # plain lists: the result goes through a pipe
    return [{**o, "t": o["t"].tolist()} for o in out]


# -- a tcp rank started by hand (python tests/_security_workers.py mesh RANK PORT OUT FLAG)
# ----------
def mesh_rank(rank: int, port: int, out: str, flag: str, timeout: float) -> None:
    """Rank 0 reveals its mesh listener and group id to the test (the attacker's best case);
    rank 1 waits for ``flag`` before it connects, so the test can attack rank 0's set-up."""
    import json
    import time
    from datetime import timedelta

    from ringlet.store import TCPStore
    from ringlet.transport.tcp import mesh as _tcp_mesh

    torch.set_num_threads(1)
    if rank == 0:
        accept = _tcp_mesh._accept_all

        def reveal(listener: Any, me: int, token: Any, gid: bytes, *args: Any) -> Any:
            with open(os.path.join(out, "mesh0.tmp"), "w") as f:
                json.dump({"port": listener.getsockname()[1], "gid": gid.hex()}, f)
            os.replace(os.path.join(out, "mesh0.tmp"), os.path.join(out, "mesh0.json"))
            return accept(listener, me, token, gid, *args)
        _tcp_mesh._accept_all = reveal
    seen = [0.0]
    if rank == 1:
        connect = _tcp_mesh._connect

        def held(*args: Any) -> Any:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.005)
            seen[0] = time.monotonic()
            return connect(*args)
        _tcp_mesh._connect = held
    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=timeout))
    dist.init_process_group("tcp", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))
    done = time.monotonic()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"value": t.item(), "after_flag_s": done - seen[0] if seen[0] else None}, f)
    dist.destroy_process_group()
    store.close()


if __name__ == "__main__":
    import ctypes
    import signal
    import sys

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the test
    if sys.argv[1] == "mesh":
        mesh_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6]))
