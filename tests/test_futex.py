"""Futex waits on shared memory: woken by another thread or process, timeouts, changed values."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

import pytest

from ringlet.transport._futex import Futex, available

pytestmark = pytest.mark.skipif(not available(), reason="no futex syscall on this platform")


def test_timeout_returns_false_and_a_changed_word_returns_at_once() -> None:
    buf = bytearray(64)
    f = Futex(buf, 8)
    t0 = time.monotonic()
    assert f.wait(0, 0.05) is False
    assert time.monotonic() - t0 >= 0.04
    struct.pack_into("<i", buf, 8, 7)
    t0 = time.monotonic()
    assert f.wait(0, 5.0) is True            # the word is 7, not 0: no sleep at all
    assert time.monotonic() - t0 < 1.0


def test_a_thread_wakes_a_waiter_long_before_its_timeout() -> None:
    buf = bytearray(64)
    f = Futex(buf, 0)
    done: list[float] = []

    def waiter() -> None:
        t0 = time.monotonic()
        while struct.unpack_from("<i", buf, 0)[0] == 0:
            f.wait(0, 10.0)
        done.append(time.monotonic() - t0)
    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    struct.pack_into("<i", buf, 0, 1)
    f.wake()
    th.join(5.0)
    assert not th.is_alive() and done and done[0] < 5.0


def test_another_process_wakes_a_waiter_through_a_shared_mapping() -> None:
    mem = mmap.mmap(-1, 4096)                # MAP_SHARED, anonymous: shared with the child
    f = Futex(mem, 128)
    pid = os.fork()
    if pid == 0:                             # child: wait for the parent's word, report the time
        code = 1
        try:
            t0 = time.monotonic()
            while struct.unpack_from("<i", mem, 128)[0] == 0 and time.monotonic() - t0 < 10:
                f.wait(0, 10.0)
            code = 0 if time.monotonic() - t0 < 5.0 else 2
        finally:
            os._exit(code)
    try:
        time.sleep(0.2)
        struct.pack_into("<i", mem, 128, 1)
        f.wake()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                return
            time.sleep(0.01)
        pytest.fail("the child was never woken")
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.parametrize("offset", [-4, 61, 2])
def test_bad_offsets_are_refused_before_any_syscall(offset: int) -> None:
    with pytest.raises(ValueError, match="Futex"):
        Futex(bytearray(64), offset)


def test_read_only_buffers_are_refused() -> None:
    with pytest.raises(TypeError):
        Futex(b"\0" * 64, 0)
