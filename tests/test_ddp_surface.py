"""DDP's newer surface (issue 10 item 3, issue 18): per-bucket caps, forward_sync_buffers and the
deprecated broadcast_buffers, batched_grad_copy, DDPCommHookType / register_ddp_comm_hook (every
member, quantization and batched PowerSGD included), _get_ddp_logging_data with sampling and logged
errors, torch.save/torch.load of a DDP model; on threads and in real processes."""

from __future__ import annotations

import _ddp_surface_workers as S
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("form", ["list", "kwarg"])
def test_per_bucket_caps(form: str) -> None:
    for r in run_threads(S.per_bucket_caps, 2, form):
        assert r["caps"] == (2000, [300, 2000]), r
        # closes at 300, then 2000
        assert r["buckets"] == [((5, 4), 312), ((3, 2, 1, 0), 1920)], r
        assert r["loss"] < 1e-12 and r["param"] < 1e-12, r


def test_forward_sync_buffers_and_the_deprecated_broadcast_buffers() -> None:
    r0, r1 = run_threads(S.buffer_options, 2)
    # (running mean after construction, at the start of forward, broadcast_buffers, warnings) on
    # rank 1
    assert r1["broadcast_false"] == (1.0, 11.0, False, ["FutureWarning"])   # no sync at all
    # synced at construction only
    assert r1["forward_false"] == (0.0, 11.0, False, [])
    # and before each forward
    assert r1["default"] == (0.0, 10.0, True, [])
    assert r1["batched"] == (0.0, 10.0, True, [])
    assert r0["default"] == (0.0, 10.0, True, [])


def test_every_comm_hook_type_registers_and_averages() -> None:
    for r in run_threads(S.hooks_by_name, 2):
        assert r["ALLREDUCE"] == ("allreduce_hook", 0, 0.0), r
        assert r["NOOP"] == ("noop_hook", 0, 0.0), r                     # the local gradient
        for name, bound in (("FP16_COMPRESS", 1e-3), ("BF16_COMPRESS", 1e-2),
                            ("QUANTIZE_PER_TENSOR", 2e-2), ("QUANTIZE_PER_CHANNEL", 2e-2)):
            assert 0 < r[name][2] < bound, (name, r[name])
        assert (r["POWER_SGD"][:2] == ("powerSGD_hook", 1)
                and r["POWER_SGD_RANK2"][:2] == ("powerSGD_hook", 2))
        assert r["BATCHED_POWER_SGD"][:2] == ("batched_powerSGD_hook", 1)
        assert r["BATCHED_POWER_SGD_RANK2"][:2] == ("batched_powerSGD_hook", 2)
        # low-rank approximations: rank 2 is closer than rank 1
        assert r["POWER_SGD_RANK2"][2] < r["POWER_SGD"][2] < 1.0, r


def test_batched_powersgd_is_exact_for_a_rank_one_bucket() -> None:
    assert max(run_threads(S.batched_powersgd_exact, 2)) < 1e-5


def test_logging_data_sampling_and_logged_errors() -> None:
    r = run_threads(S.logging_data, 2)[1]
    d = r["data"]
    # first 10, then every 2nd
    assert r["iterations"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 12, 12]
    assert (d["world_size"], d["rank"], d["module_name"], d["dtypes"],
            d["num_parameter_tensors"]) == \
        (2, 1, "Sequential", "float", 6)
    assert (d["bucket_cap_bytes"] == 25 << 20
            and d["bucket_sizes"] == "1116" == str(d["total_parameter_size_bytes"]))
    assert d["has_rebuilt_buckets"] == 1 and d["rebuilt_per_bucket_param_indices"] == "5 4 3 2 1 0"
    assert d["prev_iteration_grad_ready_order_indices"] == "5, 4, 3, 2, 1, 0"
    assert (d["can_set_static_graph"] == 1 and d["unused_parameter_size"] == 0
            and d["has_error"] == 0)
    for k in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
        assert d[k] >= 1 and d[f"avg_{k}"] >= 1, (k, d)
    assert (d["backward_compute_time"] >= d["backward_compute_comm_overlap_time"]
            <= d["backward_comm_time"])
    assert (d["backward_comm_time_end"] >= d["backward_comm_time_start"]
            >= d["backward_compute_time_start"])
    static_msg, logged = r["errors"]["static"]
    assert "should be called before training loop starts" in static_msg and logged == static_msg
    hook_msg, logged = r["errors"]["hook"]
    assert "must be callable" in hook_msg and logged == hook_msg


def test_torch_save_and_load_of_a_ddp_model() -> None:
    for r in run_threads(S.pickled, 2):
        assert (r["type"] == "DistributedDataParallel" and r["same_state"] and r["pg"]
                and r["grads_agree"]), r
        assert "only supported when using DDP with the default process group" in r["refused"], r


@pytest.mark.timeout(120)
def test_surface_in_processes() -> None:
    for r in raise_first(run_world(2, S.proc_surface, timeout=100)):
        assert (r["caps"]["buckets"] == [((5, 4), 312), ((3, 2, 1, 0), 1920)]
                and r["caps"]["param"] < 1e-12)
        assert r["hooks"]["ALLREDUCE"][2] == 0.0 and r["hooks"]["QUANTIZE_PER_TENSOR"][2] < 2e-2
        assert r["logging"]["backend_name"] == "shm" and r["logging"]["iteration"] == 12
        p = r["pickled"]
        assert p["same_state"] and p["grads_agree"] and "default process group" in p["refused"], p
