"""A plain import of ringlet loads none of torch's compiler stack ([Note: lazy compiler disable]
in ringlet/_compile.py), and the functions ringlet keeps out of torch.compile's graphs look to
dynamo exactly like ``torch.compiler.disable``'d ones once it is loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Imported by torch.compile (through torch._dynamo) and never by `import torch` itself: each costs
# from tenths of a second to seconds at start-up.
HEAVY = ("torch._dynamo", "torch._inductor", "torch._functorch.aot_autograd",
         "torch.fx.experimental.symbolic_shapes", "sympy", "matplotlib", "triton")

IMPORTS = ("ringlet.distributed", "ringlet.nn.parallel", "ringlet.distributed.fsdp",
           "ringlet.distributed.tensor", "ringlet.distributed.tensor.parallel",
           "ringlet.distributed.device_mesh", "ringlet.distributed.checkpoint")


def _fresh(code: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.timeout(150)
def test_plain_imports_load_no_compiler_module() -> None:
    code = f"""
import sys
import {", ".join(IMPORTS)}
from ringlet._compile import compiler_disable
compiler_disable(abs)(-1)            # a disabled function called before dynamo is loaded
heavy = {HEAVY!r}
print([m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy))])
"""
    assert _fresh(code).strip() == "[]"


# Compile g, which calls `fn` (ringlet's or torch's disabled version of body), and report what
# dynamo saw: graphs, graph breaks, frames compiled, and whether body ran under the compiler.
_PROBE = """
import json, sys, torch
{first}
from ringlet._compile import compiler_disable

def inner(x):
    return x * 2

def body(x):
    seen.append(torch.compiler.is_compiling())
    return inner(x) + 1

seen = []
kinds = {{"ringlet": compiler_disable(body), "torch": torch.compiler.disable(body)}}
import torch._dynamo
from torch._dynamo.utils import counters

def g_of(fn):
    def g(x):
        return fn(x.sin()).cos()
    return g

out = {{}}
for name, fn in kinds.items():
    torch._dynamo.reset()
    counters.clear()
    seen.clear()
    explained = torch._dynamo.explain(g_of(fn))(torch.ones(3))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(g_of(fn), backend="eager")
    value = [compiled(torch.ones(3)).tolist() for _ in range(2)]
    out[name] = [explained.graph_count, explained.graph_break_count,
                 dict(counters["frames"]), seen[-2:], value]
print(json.dumps(out))
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("first", ["import ringlet.distributed", "import torch._dynamo"])
def test_ringlet_disable_is_seen_by_dynamo_as_torchs(first: str) -> None:
    """Whether ringlet or torch._dynamo is imported first: one graph break at the call, the
    wrapper's own frame and everything the function calls run uncompiled, same results."""
    got = json.loads(_fresh(_PROBE.format(first=first), timeout=180).strip().splitlines()[-1])
    assert got["ringlet"] == got["torch"], got
    graphs, breaks, frames, seen, _ = got["ringlet"]
    assert (graphs, breaks, seen) == (2, 1, [False, False]), got
    assert frames == {"total": 2, "ok": 2}, got          # g and its resume after the break


def test_compiler_disable_rejects_what_is_not_callable() -> None:
    from ringlet._compile import compiler_disable

    with pytest.raises(TypeError, match="compiler_disable: expected a callable, got int"):
        compiler_disable(3)  # type: ignore[arg-type]
