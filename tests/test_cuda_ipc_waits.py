"""``cuda_ipc``'s bounded event waits (``waits.EventWaiter``), with CPU stand-in events."""

from __future__ import annotations

import threading
import time

import pytest

from weightsync.transport.backends.cuda_ipc.waits import MAX_STUCK, EventWaiter

pytestmark = pytest.mark.timeout(60)


class Ev:
    """An event the test completes by hand; ``block`` waits for it on the helper thread."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.blocked_on: list[str] = []


class Device:
    def __init__(self) -> None:
        self.queries = 0
        self.blocks = 0

    def done(self, ev: Ev) -> bool:
        self.queries += 1
        return ev.flag.is_set()

    def block(self, ev: Ev) -> None:
        self.blocks += 1
        ev.blocked_on.append(threading.current_thread().name)
        ev.flag.wait()


def _waiter(mode: str = "block") -> tuple[EventWaiter, Device]:
    dev = Device()
    return EventWaiter(dev.block, dev.done, mode=mode, name="test-wait"), dev


def test_a_blocked_wait_returns_once_the_event_is_done_without_polling():
    w, dev = _waiter()
    ev = Ev()
    threading.Timer(0.2, ev.flag.set).start()
    assert w.wait(ev, deadline=time.monotonic() + 30)
    assert dev.queries == 1 and dev.blocks == 1      # one look, then the helper blocked
    assert ev.blocked_on == ["test-wait"]            # ... on its own thread
    assert w.wait(ev, deadline=time.monotonic() + 30) and dev.blocks == 1   # done: no block
    w.close()


def test_poll_mode_queries_until_done():
    w, dev = _waiter("poll")
    ev = Ev()
    threading.Timer(0.1, ev.flag.set).start()
    assert w.wait(ev, deadline=time.monotonic() + 30)
    assert dev.blocks == 0 and dev.queries > 1


def test_each_calling_thread_has_its_own_helper():
    """Two threads wait on two events; the second event completes first and its waiter
    returns while the first still blocks (one shared helper would hold it behind)."""
    w, _ = _waiter()
    first, second = Ev(), Ev()
    returned: dict[str, float] = {}

    def wait(name: str, ev: Ev) -> None:
        w.wait(ev, deadline=time.monotonic() + 30)
        returned[name] = time.monotonic()

    threads = [threading.Thread(target=wait, args=("first", first)),
               threading.Thread(target=wait, args=("second", second))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    second.flag.set()
    threads[1].join(10)
    assert "second" in returned and "first" not in returned
    first.flag.set()
    threads[0].join(10)
    assert "first" in returned
    w.close()


def test_deadline_leaves_the_helper_and_the_next_wait_gets_a_fresh_one():
    w, dev = _waiter()
    stuck = Ev()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        w.wait(stuck, deadline=time.monotonic() + 0.1)
    assert 0.05 < time.monotonic() - t0 < 10 and w.stuck == 1
    fine = Ev()
    threading.Timer(0.05, fine.flag.set).start()
    assert w.wait(fine, deadline=time.monotonic() + 30)
    assert dev.blocks == 2    # a new helper took it while the old one still blocks
    left = [stuck] + [Ev() for _ in range(MAX_STUCK - 1)]
    for ev in left[1:]:
        with pytest.raises(TimeoutError):
            w.wait(ev, deadline=time.monotonic() + 0.05)
    assert w.stuck == MAX_STUCK
    blocks = dev.blocks
    late = Ev()
    threading.Timer(0.05, late.flag.set).start()
    assert w.wait(late, deadline=time.monotonic() + 30)
    assert dev.blocks == blocks and dev.queries > 3     # polled, no more helpers
    for ev in left:
        ev.flag.set()    # the helpers left behind end once their events are done
    w.close()


def test_give_up_returns_false_and_is_not_counted_as_stuck():
    w, _ = _waiter()
    ev = Ev()
    over = threading.Event()
    threading.Timer(0.1, over.set).start()
    assert w.wait(ev, deadline=time.monotonic() + 30, give_up=over.is_set) is False
    assert w.stuck == 0
    ev.flag.set()
    w.close()


def test_an_error_while_blocked_reaches_the_caller():
    def block(ev):
        raise RuntimeError("CUDA error: an illegal memory access")
    w = EventWaiter(block, lambda ev: False)
    with pytest.raises(RuntimeError, match="illegal memory"):
        w.wait(object(), deadline=time.monotonic() + 30)
    w.close()


def test_close_ends_idle_helpers():
    w, _ = _waiter()
    before = threading.active_count()
    pending = Ev()
    threading.Timer(0.05, pending.flag.set).start()
    assert w.wait(pending, deadline=time.monotonic() + 30)
    assert any(th.name == "test-wait" for th in threading.enumerate())
    w.close()
    deadline = time.monotonic() + 10
    while any(th.name == "test-wait" for th in threading.enumerate()):
        assert time.monotonic() < deadline, "helpers still running after close()"
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_bad_mode_is_a_value_error():
    with pytest.raises(ValueError, match="mode"):
        EventWaiter(lambda ev: None, lambda ev: True, mode="spin")
