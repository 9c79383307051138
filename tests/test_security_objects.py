"""Restricted object mode (``RINGLET_SAFE_OBJECTS=1``) never hands a rank an object that can
corrupt its memory or inflate past the size cap (docs/security.md, "Object collectives").

The hostile tensors travel from a real peer process; the receiver is another process, so a
tensor that got through and crashed it shows up as a dead rank, never as a crashed pytest.
"""

from __future__ import annotations

import collections
import io
import re
import warnings
import zipfile

import _security_objects_workers as W
import pytest
import torch

from ringlet.c10d import _restricted, objects
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(90)

SAFE = {"RINGLET_SAFE_OBJECTS": "1"}


def _refusals(outcomes: list[str], names: list[str]) -> dict[str, str]:
    got = dict(o.split(": ", 1) for o in outcomes[:-1])
    assert list(got) == names, outcomes
    return got


# -- sparse invariants ---------------------------------------------------------------------------
def test_sparse_tensors_with_bad_indices_are_refused_and_the_receiver_survives() -> None:
    res = run_world(2, W.hostile_round, "sparse", env=SAFE, timeout=60)
    sent, received = raise_first(res)      # rank 1 alive: it never crashed on what it got
    names = list(W.sparse_tensors())
    for name, outcome in _refusals(received, names).items():
        assert outcome.startswith("UnpicklingError"), (name, outcome)
        assert "refuses the object from rank 0" in outcome, (name, outcome)
        assert ("does not rebuild into valid tensors" in outcome
                or "breaks its invariants" in outcome), (name, outcome)
    assert received[-1] == "valid: [0.0, 2.0, 0.0, 0.0, 3.0, 0.0]"
    assert sent[-1] == received[-1]


def test_views_outside_their_storage_never_reach_the_receiver() -> None:
    """Strided, legacy, quantized, nested and wrapper rebuilds with offsets, sizes or strides
    outside their storage: torch checks them as it builds them; each is refused here."""
    res = run_world(2, W.hostile_round, "strided", env=SAFE, timeout=60)
    _, received = raise_first(res)
    for name, outcome in _refusals(received, list(W.strided_tensors())).items():
        assert outcome.startswith("UnpicklingError"), (name, outcome)
        assert "refuses the object from rank 0" in outcome, (name, outcome)


def test_meta_tensors_carry_no_memory_and_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    payload = objects._encode([torch.empty(10**12, device="meta")])
    assert payload is not None
    got = objects._decode(payload, 0, "broadcast_object_list")[0]
    assert got.device.type == "meta" and got.shape == (10**12,)


def _bad_coo() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[10**9]]), torch.ones(1), (6,),
                                   check_invariants=False)


class _Holder:
    def __init__(self, value: object) -> None:
        self.value = value


class _Slotted:
    __slots__ = "value"  # noqa: PLC0205 - one slot spelled as a string, as a peer may

    def __init__(self, value: object) -> None:
        self.value = value


def test_every_tensor_of_a_decoded_object_is_checked() -> None:
    """The explicit walk finds a bad sparse tensor wherever it hides (it does not rely on the
    process-wide list torch keeps, which another thread's torch.load may clear)."""
    bad = _bad_coo()
    dense = torch.ones(6)
    dense.grad = bad
    tagged = torch.ones(2)
    tagged.note = [bad]        # a tensor's own attribute
    deep: list[object] = [bad]
    for _ in range(100_000):   # deeper than the recursion limit
        deep = [deep]
    for where in ([bad], {bad: 1}, {"k": (1, {bad})}, frozenset([bad]), _Holder(bad),
                  _Slotted(bad), dense, tagged, deep, torch.nn.Parameter(bad)):
        why = _restricted.check_tensors(where)
        assert why is not None and "sparse_coo tensor of shape [6]" in why, type(where)
    assert _restricted.check_tensors({"ok": [torch.ones(2), torch.eye(3).to_sparse(),
                                             torch.eye(3).to_sparse_csr()]}) is None


def test_refused_even_when_torch_skips_its_own_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's torch.load can clear torch's list of sparse tensors to validate before
    this load validates them (simulated by skipping torch's validation): still refused."""
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    monkeypatch.setattr(torch._utils, "_validate_loaded_sparse_tensors",
                        lambda: torch._utils._sparse_tensors_to_validate.clear())
    payload = objects._encode({"x": [W._csr_issue()]})
    assert payload is not None
    with pytest.raises(Exception, match="refuses the object from rank 2: a sparse_csr tensor of "
                                        r"shape \[2, 3\] breaks its invariants"):
        objects._decode(payload, 2, "all_gather_object")


def test_memory_the_payload_did_not_carry_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Legacy constructors (``torch.Tensor(n)``, ``UntypedStorage(n)``) allocate what a tiny
    payload asks for: the tensors and storages of a decoded object hold at most the cap."""
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    monkeypatch.setattr(objects, "MAX_OBJECT_BYTES", 8192)
    small = objects._encode({"t": W._Rebuild(torch.Tensor, 1000)})
    assert small is not None and objects._decode(small, 0, "x")["t"].shape == (1000,)
    for what, obj in (("tensor", W._Rebuild(torch.Tensor, 5000)),
                      ("storage", W._Rebuild(torch.UntypedStorage, 20000)),
                      ("two tensors", [W._Rebuild(torch.Tensor, 1500)] * 2 + [torch.ones(900)])):
        payload = objects._encode(obj)
        assert payload is not None and len(payload) < 8192, what
        with pytest.raises(Exception, match=r"refuses the object from rank 1: its tensors hold "
                                            r"\d+ bytes, above the 8192-byte cap"):
            objects._decode(payload, 1, "broadcast_object_list")


def test_a_typed_storage_counts_against_the_cap() -> None:
    """A (legacy) TypedStorage in a decoded object counts its bytes like an UntypedStorage (the
    check once called a method TypedStorage does not have, found by mypy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # TypedStorage is deprecated
        typed = torch.storage.TypedStorage(3000, dtype=torch.float32)
    why = _restricted.check_tensors({"s": typed}, cap=8192)
    assert why is not None and "hold 12000 bytes, above the 8192-byte cap" in why, why
    assert _restricted.check_tensors([typed], cap=12000) is None


def _plain_data_of_every_allowed_kind() -> dict[str, object]:
    return {"list": [1, 2.5, "x", None, True, -5, 2**100], "set": {1, 2},
            "counter": collections.Counter("aab"), "od": collections.OrderedDict(a=1),
            "bytearray": bytearray(b"\x00\xff"), "empty": bytearray(), "bytes": b"xy",
            "complex": 1 + 2j, "size": torch.Size([2, 3]), "tuple": (1, (2, 3)),
            "tensor": torch.ones(3), "param": torch.nn.Parameter(torch.ones(2)),
            "coo": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "dtype": torch.float16, "device": torch.device("cpu")}


@pytest.mark.parametrize(("what", "call", "args"), [
    ("a count", bytearray, (10**6,)), ("a count", bytes, (10**6,)),
    ("a tensor or storage", set, (torch.ones(10),)),
    ("a tensor or storage", collections.Counter, (torch.ones(5),)),
    ("a tensor or storage", torch.Size, (torch.ones(3, dtype=torch.int64),)),
    ("a tensor or storage", set, (torch.ones(3).untyped_storage(),))])
def test_calls_that_amplify_the_payload_are_refused_before_running(
        monkeypatch: pytest.MonkeyPatch, what: str, call: object, args: tuple) -> None:
    """``bytearray(10**10)`` is a 50-byte payload that zero-fills 10 GB; ``set(t)`` makes one
    Python object per element of a tensor or storage: found in the pickle, before it runs."""
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    name = f"{getattr(call, '__module__', '')}.{getattr(call, '__name__', '')}"
    ran: list[object] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: ran.append(a))
    payload = objects._encode({"x": [W._Rebuild(call, *args)]})
    assert payload is not None
    with pytest.raises(Exception, match=rf"refuses the object from rank 0: {re.escape(name)} is "
                                        rf"called (with|on) {what}"):
        objects._decode(payload, 0, "all_gather_object")
    assert not ran                                   # refused before torch.load ran
    monkeypatch.undo()
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    plain = _plain_data_of_every_allowed_kind()
    got = objects._decode(objects._encode(plain), 0, "x")
    assert set(got) == set(plain) and got["counter"] == plain["counter"]


# -- compression and declared sizes --------------------------------------------------------------
def _recompress(archive: bytes, method: int, only: str = "") -> bytes:
    """The same archive with its records (or those ending with ``only``) written with
    ``method``."""
    src, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info),
                         compress_type=method if info.filename.endswith(only) else 0)
    return out.getvalue()


def _archive(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_compressed_record_is_refused_before_inflating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record of DEFLATE-compressed zeros (1 MiB in about 1 KiB here; 2.5 GiB in 2.4 MB in the
    report) is refused from the archive's directory, before anything is inflated."""
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    bomb = _recompress(_archive({"z": torch.zeros(1 << 20, dtype=torch.uint8)}),
                       zipfile.ZIP_DEFLATED, only="data/0")
    assert len(bomb) < 16 << 10
    inflated: list[str] = []

    def no_inflate(*args: object, **kw: object) -> object:
        inflated.append("zipfile")
        raise AssertionError("a record was inflated")
    monkeypatch.setattr(zipfile, "_get_decompressor", no_inflate)
    with pytest.raises(Exception, match=r"refuses the object from rank 1: record "
                                        r"'archive/data/0' is compressed \(zip method 8\)"):
        objects._decode(objects.SAFE_MAGIC + bomb, 1, "recv_object_list")
    assert not inflated


def test_compressed_data_pkl_is_refused_without_inflating_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    archive = _recompress(_archive({"a": 1}), zipfile.ZIP_DEFLATED, only="data.pkl")
    monkeypatch.setattr(zipfile, "_get_decompressor",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("inflated")))
    with pytest.raises(Exception, match="record 'archive/data.pkl' is compressed"):
        objects._decode(objects.SAFE_MAGIC + archive, 0, "broadcast_object_list")
    assert _restricted._stored_record(archive, "data.pkl") == b""


def test_declared_sizes_above_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    archive = _archive({"t": torch.zeros(4096, dtype=torch.uint8)})
    assert objects._decode(objects.SAFE_MAGIC + archive, 0, "x")["t"].numel() == 4096
    monkeypatch.setattr(objects, "MAX_OBJECT_BYTES", 4000)
    with pytest.raises(Exception, match="its records declare more than the 4000-byte cap"):
        objects._decode(objects.SAFE_MAGIC + archive, 0, "gather_object")


def test_archive_with_a_comment_or_a_lying_size_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory torch's reader finds must be the one checked: the archive has to end with
    it, and a stored record's declared size must be what it stores."""
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    archive = _archive({"a": torch.ones(3)})
    with pytest.raises(Exception, match="ends with its zip directory"):
        objects._decode(objects.SAFE_MAGIC + archive + b"trailing", 0, "x")
    info = next(i for i in zipfile.ZipFile(io.BytesIO(archive)).infolist()
                if i.filename.endswith("data/0"))
    pos = archive.index(info.filename.encode(), archive.index(b"PK\x01\x02")) - 46
    assert archive[pos:pos + 4] == b"PK\x01\x02"     # its central directory entry
    lying = bytearray(archive)
    lying[pos + 24:pos + 28] = (1 << 30).to_bytes(4, "little")   # uncompressed size
    with pytest.raises(Exception, match="declares 1073741824 bytes but stores 12"):
        objects._decode(objects.SAFE_MAGIC + bytes(lying), 0, "x")


# -- broadcast_object_list(None) -----------------------------------------------------------------
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_broadcast_object_list_of_none_is_a_clear_error_and_the_group_survives(
        bad_rank: int) -> None:
    res = run_world(2, W.bad_list_round, bad_rank, timeout=60)
    outs = raise_first(res)
    own = "TypeError: broadcast_object_list: object_list: expected a list of objects, got NoneType"
    assert outs[bad_rank][0] == own
    if bad_rank == 0:      # the source: every rank gets the error, none waits
        assert outs[1][0].startswith("TypeError: broadcast_object_list: the source rank 0 passed "
                                     "an object_list that is not a list")
    else:
        assert outs[0][0] == "ok"
    assert [o[1] for o in outs] == ["from 0 2.0", "from 0 2.0"]
