"""What rank 0 prints at the start and the end, and the files it leaves in ``--out``.

``metrics.json``: the losses and per-rank times of the run.  ``train_gpt.png``: training and
validation loss, and where each rank's time went (matplotlib, if installed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .model import count_parameters
from .observe import Window, breakdown_table

PLOT_NAME = "train_gpt.png"


def print_header(write: Callable[[str], None], cfg: Any, par: Any, data: Any, start: int) -> None:
    import ringlet.distributed as dist

    n = count_parameters(par.raw.cfg)
    tokens = cfg.batch_size * cfg.block_size
    write(f"train_gpt: {cfg.strategy} ({par.layout}) on {dist.get_world_size()} ranks over "
          f"'{dist.get_backend()}', {n / 1e6:.2f}M parameters, {'bf16' if cfg.bf16 else 'fp32'}")
    write(f"data: {data.description}: {len(data.train) / 1e6:.2f}M bytes to train on, "
          f"{len(data.val) / 1e6:.2f}M held out")
    write(f"batch: {cfg.batch_size} x {cfg.block_size} tokens per step ({tokens} tokens"
          + (f", {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
          + f"), {cfg.steps} steps"
          + (f", resuming after step {start}" if start else ""))
    if (note := par.layout.shards_nothing()) is not None:
        write(note)


def finish(cfg: Any, par: Any, history: dict[str, Any], totals: list[Window], sample: str,
           start: int, lines: list[str] | None = None) -> None:
    """The summary table (``lines`` instead, if given), the sample, ``metrics.json`` and the
    plot."""
    for line in summary_lines(cfg, par, history, totals, start) if lines is None else lines:
        print(line, flush=True)
    if sample:
        print("sample (held-out prompt, then the model's continuation):", flush=True)
        print("    " + sample.replace("\n", "\n    "), flush=True)
    os.makedirs(cfg.out, exist_ok=True)
    metrics = {"config": asdict(cfg), "layout": str(par.layout), "history": history,
               "ranks": [asdict(w) for w in totals]}
    png = os.path.join(cfg.out, PLOT_NAME)
    if cfg.plot:
        try:
            metrics["plot_series"] = plot(png, cfg, par, history, totals)
            print(f"plot: {png}", flush=True)
        except ImportError:
            print("plot: skipped (matplotlib is not installed: pip install -e '.[examples]')",
                  flush=True)
    with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"metrics: {os.path.join(cfg.out, 'metrics.json')}", flush=True)


def summary_lines(cfg: Any, par: Any, history: dict[str, Any], totals: list[Window],
                  start: int) -> list[str]:
    steps = cfg.steps - start
    tokens = steps * cfg.batch_size * cfg.block_size
    wall = history["wall_s"]
    losses = history["train_loss"]
    val = history["val"]
    lines = [f"== summary: {cfg.strategy} ({par.layout}), {len(totals)} ranks ==",
             (f"trained steps {start + 1}-{cfg.steps} ({tokens / 1e6:.2f}M tokens) in {wall:.1f} "
              f"s: {tokens / max(wall, 1e-9) / 1e3:.1f}k tokens/s"),
             f"training loss {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {len(losses)})"]
    if val:
        lines.append("validation loss " + ", ".join(f"{v:.3f} (step {s})" for s, v in val))
    lines += breakdown_table(totals, "per-rank time over the run:")
    n0 = max(1, totals[0].steps)
    lines.append("collectives per step on rank 0: " + ", ".join(
        f"{op} {n / n0:.1f}" for op, n in sorted(totals[0].by_op.items()) if n / n0 >= 0.05))
    lines.append("  rank   comm elements/step   peak RSS MiB   params+grads+Adam MiB")
    for r, w in enumerate(totals):
        lines.append(f"  {r:>4}   {w.elements / max(1, w.steps) / 1e6:14.2f}M   "
                     f"{w.rss_mib:12.0f}   {w.state_mib:21.2f}")
    return lines


def plot(path: str, cfg: Any, par: Any, history: dict[str, Any], totals: list[Window]) -> list[str]:
    """Write the PNG; returns the names of the series it shows (from the legends)."""
    import matplotlib

    matplotlib.use("Agg")          # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))
    steps = range(1, len(history["train_loss"]) + 1)
    ax_loss.plot(steps, history["train_loss"], lw=1, label="training loss")
    if history["val"]:
        vs, vl = zip(*history["val"], strict=True)
        ax_loss.plot(vs, vl, "o-", label="validation loss")
    _mark_failures(ax_loss, history.get("ft"))
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/byte)",
                title=f"train_gpt.py --strategy {cfg.strategy} ({par.layout})"
                + (" --fault-tolerant" if getattr(cfg, "fault_tolerant", False) else ""))
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ranks = list(range(len(totals)))
    left = [0.0] * len(totals)
    for i, name in enumerate(("compute", "comm wait", "data")):
        ms = [w.fractions()[i] * w.step_s / max(1, w.steps) * 1e3 for w in totals]
        ax_time.barh(ranks, ms, left=left, height=0.6, label=name)
        left = [a + b for a, b in zip(left, ms, strict=True)]
    if not any(w.steps for w in totals):    # --fault-tolerant: rejoined after the last step
        ax_time.text(0.5, 0.5, "these processes trained no step:\nthey rejoined after the last",
                     ha="center", va="center", transform=ax_time.transAxes)
    ax_time.set(xlabel="ms per step", ylabel="rank", yticks=ranks,
                title="where each rank's time went")
    ax_time.invert_yaxis()
    ax_time.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    names = [t.get_text() for ax in (ax_loss, ax_time) for t in ax.get_legend().get_texts()]
    plt.close(fig)
    return names


def _mark_failures(ax: Any, ft: dict[str, Any] | None) -> None:
    """``--fault-tolerant``: a red line at each failure's step, a green one at each rejoin."""
    for f in (ft or {}).get("failures", []):
        ax.axvline(f["step"], color="tab:red", ls="--", lw=1,
                   label=f"replica {f['replica']} lost (step {f['step']})")
    for r in (ft or {}).get("rejoins", []):
        ax.axvline(r["step"], color="tab:green", ls=":", lw=1.5,
                   label=f"replica {r['replica']} rejoined (step {r['step']})")
