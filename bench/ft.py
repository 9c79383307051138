"""Kill a random rank at a random step, again and again: ringlet.ft against restart-from-checkpoint.

Two layouts on 4 processes: DDP (4 replicas of one process) and HSDP 2x2 (2 replicas, each a
fully_shard group of 2).  Each run kills one random rank (SIGKILL, after its backward) at a random
step of a ``--steps``-step job (bench/_ft_job.py), once under ringlet.ft (``ringlet-run
--restart-policy replica``: the survivors go on, the killed replica restarts and heals) and once
as torchrun users do it today (``ringlet-run --max-restarts 1``: every worker restarts and resumes
from the last checkpoint, saved every ``--ckpt-every`` steps).  For every run it checks that the
job finished and that, at every step, all live replicas held bitwise-identical parameters, and it
measures the time lost:

- ft: the survivors' stall (the failed step's time beyond the median step) plus what the rejoin
  cost them (the healing step beyond the median), and how long the killed replica took to be back;
- restart: the time from the failure until the job was again at the step it failed in (restart,
  reload, and the steps recomputed since the checkpoint).

and the final loss (a fixed held-out batch) against an uninterrupted run of the same job.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import _common

JOB = Path(__file__).with_name("_ft_job.py")
LAYOUTS = {"ddp": 1, "hsdp": 2}     # processes per replica
NPROC = 4


def _launch(out: Path, mode: str, size: int, steps: int, kill: tuple[int, int] | None,
            ckpt_every: int, timeout: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", str(NPROC),
           "--max-restarts", "2"]
    env = dict(os.environ)
    if mode == "ft":
        cmd += ["--restart-policy", "replica", "--replica-size", str(size)]
    else:
        env["FT_BENCH_REPLICA_SIZE"] = str(size)
    cmd += [str(JOB), mode, str(out), "--steps", str(steps), "--ckpt-every", str(ckpt_every)]
    if kill is not None:
        cmd += ["--kill", str(kill[0]), "--kill-step", str(kill[1])]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=30)
        text += f"\n(bench: killed after {timeout:.0f} s)"
    return proc.returncode, text, time.monotonic() - t0


def _rows(out: Path) -> tuple[list[dict], dict[int, float]]:
    rows, finals = [], {}
    for f in out.glob("r*.jsonl"):
        rank = int(f.name[1:-len(".jsonl")])
        for line in f.read_text().splitlines():
            row = json.loads(line)
            if "final_loss" in row:
                finals[rank] = row["final_loss"]
            else:
                rows.append({**row, "rank": rank})
    return sorted(rows, key=lambda r: r["t"]), finals


def _identical(rows: list[dict], size: int) -> bool:
    seen: dict[tuple[int, int], set[str]] = defaultdict(set)
    for r in rows:
        seen[(r["step"], r["rank"] % size)].add(r["hash"])
    return all(len(h) == 1 for h in seen.values())


def _step_times(rows: list[dict], rank: int) -> dict[int, float]:
    """step -> when ``rank`` began it (its last incarnation's time where it began it twice)."""
    return {r["step"]: r["t"] for r in rows if r["rank"] == rank}


def _ft_costs(rows: list[dict], kill: tuple[int, int], size: int) -> dict[str, float]:
    dead_replica, step = kill[0] // size, kill[1]
    survivor = next(r for r in range(NPROC) if r // size != dead_replica)
    times = _step_times(rows, survivor)
    durations = {s: times[s + 1] - times[s] for s in times if s + 1 in times}
    typical = statistics.median(durations.values())
    stall = durations.get(step, typical) - typical
    back = [r for r in rows if r["rank"] == kill[0] and r["inc"] > 0]
    heal_step = back[0]["step"] if back else None
    heal = (durations.get(heal_step - 1, typical) - typical) if heal_step else float("nan")
    killed_at = times[step]
    return {"stall": stall, "heal": heal, "lost": stall + (0.0 if math.isnan(heal) else heal),
            "rejoin": (back[0]["t"] - killed_at) if back else float("nan"), "step_s": typical}


def _restart_costs(rows: list[dict], kill: tuple[int, int]) -> dict[str, float]:
    first = [r for r in rows if r["rank"] == 0 and r["step"] == kill[1]]
    if len(first) < 2:
        return {"lost": float("nan")}
    times0 = _step_times([r for r in rows if r["inc"] == 0], 0)
    durations = [times0[s + 1] - times0[s] for s in times0 if s + 1 in times0]
    return {"lost": first[-1]["t"] - first[0]["t"], "step_s": statistics.median(durations)}


def _one(tmp: Path, mode: str, layout: str, steps: int, kill: tuple[int, int] | None,
         ckpt_every: int, timeout: float) -> dict[str, object]:
    out = tmp / f"{layout}-{mode}-{kill}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    size = LAYOUTS[layout]
    code, text, wall = _launch(out, mode, size, steps, kill, ckpt_every, timeout)
    rows, finals = _rows(out)
    result: dict[str, object] = {"ok": code == 0 and bool(finals), "code": code, "wall": wall,
                                 "identical": _identical(rows, size),
                                 "final": statistics.median(finals.values()) if finals else None}
    if kill is not None and rows:
        try:
            result.update(_ft_costs(rows, kill, size) if mode == "ft"
                          else _restart_costs(rows, kill))
        except (KeyError, StopIteration, statistics.StatisticsError) as e:
            result["error"] = f"{type(e).__name__}: {e}"
    if not result["ok"]:
        result["tail"] = text[-3000:]
    return result


def _fmt(xs: list[float], unit: str = " s", digits: int = 2) -> str:
    xs = [x for x in xs if isinstance(x, float) and not math.isnan(x)]
    if not xs:
        return "-"
    return (f"{statistics.median(xs):.{digits}f}{unit} ({min(xs):.{digits}f}-"
            f"{max(xs):.{digits}f})")


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__, ranks=None)
    p.add_argument("--runs", type=int, default=10, help="kills per layout")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--layouts", default="ddp,hsdp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=400.0, help="per job, s")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="ringlet-ft-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for layout in a.layouts.split(","):
            base = {m: _one(tmp, m, layout, a.steps, None, a.ckpt_every, a.timeout)
                    for m in ("ft", "restart")}
            print(f"{layout}: uninterrupted final loss ft {base['ft']['final']}, restart "
                  f"{base['restart']['final']}", flush=True)
            got: dict[str, list[dict]] = {"ft": [], "restart": []}
            for i in range(a.runs):
                kill = (rng.randrange(NPROC), rng.randrange(3, a.steps - a.ckpt_every))
                for mode in ("ft", "restart"):
                    r = _one(tmp, mode, layout, a.steps, kill, a.ckpt_every, a.timeout)
                    got[mode].append(r)
                    print(f"{layout} run {i + 1}/{a.runs} {mode}: kill rank {kill[0]} at step "
                          f"{kill[1]}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float)
                                                    else f"{k} {v}" for k, v in r.items()
                                                    if k != "tail"), flush=True)
                    if not (r["ok"] and r["identical"]):
                        failures.append((layout, mode, kill, r.get("tail", "")))
            rows.append(_table_row(layout, base, got, a.runs))
    headers = ["layout", "ft: finished / identical", "ft: survivors' stall", "ft: heal step",
               "ft: lost per failure", "ft: replica back after", "restart: finished",
               "restart: lost per failure", "median step ft / restart", "final loss ft",
               "final loss restart", "final loss uninterrupted"]
    _common.emit(lambda md: (_common.markdown_table if md else _common.text_table)(headers, rows),
                 lambda md: _common.preamble("ringlet.ft: kill a random rank", [
                     (f"{NPROC} processes; {a.steps} steps; checkpoint every {a.ckpt_every} "
                      f"steps (restart mode); {a.runs} kills per layout; seed {a.seed}")],
                     _common.machine_info(), md), a.markdown)
    for layout, mode, kill, tail in failures:
        print(f"\nFAILED {layout} {mode} kill {kill}:\n{tail}")
    sys.exit(1 if failures else 0)


def _table_row(layout: str, base: dict, got: dict, runs: int) -> list[str]:
    ft, rs = got["ft"], got["restart"]
    return [layout,
            f"{sum(r['ok'] for r in ft)}/{runs} / {sum(r['identical'] for r in ft)}/{runs}",
            _fmt([r.get("stall") for r in ft]), _fmt([r.get("heal") for r in ft]),
            _fmt([r.get("lost") for r in ft]), _fmt([r.get("rejoin") for r in ft]),
            f"{sum(r['ok'] for r in rs)}/{runs}", _fmt([r.get("lost") for r in rs]),
            (f"{_median([r.get('step_s') for r in ft]) * 1e3:.1f} / "
             f"{_median([r.get('step_s') for r in rs]) * 1e3:.1f} ms"),
            *(_fmt([r["final"] for r in x if r["final"] is not None], "", 4)
              for x in (ft, rs, [base["ft"], base["restart"]]))]


def _median(xs: list[object]) -> float:
    got = [x for x in xs if isinstance(x, float) and not math.isnan(x)]
    return statistics.median(got) if got else float("nan")


if __name__ == "__main__":
    main()
