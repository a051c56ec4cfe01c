"""How late a host sees an interprocess CUDA event complete, by way of waiting (issue 20).

``cuda_ipc`` waits on the host for events of the other process (a bucket filled, a slot
drained, the receivers' last reads). This measures, on one GPU, the delay between the GPU
finishing the work behind an event and the host returning from its wait:

* ``poll``: ``query()`` with sleeps doubling from 10 us to a cap (``--cap-us``; the
  engine's own loop, ``CudaIpcEngine._wait_event``, caps at 100 us);
* ``spin``: ``query()`` with no sleep (the lower bound of polling);
* ``thread``: a helper thread blocks in ``synchronize()`` (the GIL released) and sets a
  ``threading.Event`` the caller waits on with a timeout;
* ``sync``: ``synchronize()`` on the caller's thread (no timeout possible: reference only).

Each trial launches a GPU sleep of ``--work-ms`` between two timing events, records the
interprocess event behind it, waits, and takes ``lag = host wall time from launch to the
wait's return - the GPU's elapsed time``. Usage: ``python benchmarks/event_wait_lag.py``.
Session 23 (BENCHMARKS.md) tried the ``thread`` way inside ``cuda_ipc`` and measured no
change in a sync, so the engine still polls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def cycles_for(ms: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that take about ``ms``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 10_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def wait_poll(ev: torch.cuda.Event, cap: float) -> None:
    delay = 10e-6
    while not ev.query():
        time.sleep(delay)
        delay = min(2 * delay, cap)


def wait_spin(ev: torch.cuda.Event) -> None:
    while not ev.query():
        pass


class Waiter:
    """A daemon thread that blocks in ``synchronize()`` for the caller."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.cv = threading.Condition()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while True:
            with self.cv:
                while not self.jobs:
                    self.cv.wait()
                ev, flag = self.jobs.pop(0)
            ev.synchronize()
            flag.set()

    def wait(self, ev: torch.cuda.Event) -> None:
        flag = threading.Event()
        with self.cv:
            self.jobs.append((ev, flag))
            self.cv.notify()
        while not flag.wait(0.005):
            pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-ms", type=float, default=3.0)
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--cap-us", type=float, default=100.0)
    args = ap.parse_args()
    torch.cuda.init()
    cycles = cycles_for(args.work_ms)
    ipc = torch.cuda.Event(interprocess=True)
    waiter = Waiter()
    ways = {"poll": lambda e: wait_poll(e, args.cap_us * 1e-6), "spin": wait_spin,
            "thread": waiter.wait, "sync": lambda e: e.synchronize()}
    out: dict = {}
    for rnd in range(2):
        for name, wait in ways.items():
            lags = []
            for _ in range(args.trials):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
                ipc.record()
                wait(ipc)
                wall = (time.perf_counter() - t0) * 1e3
                b.synchronize()
                lags.append(wall - a.elapsed_time(b))
            out.setdefault(name, []).append(round(statistics.median(lags) * 1e3, 1))
            print(f"round {rnd} {name:6s} lag median {statistics.median(lags) * 1e3:7.1f} us"
                  f"  p90 {sorted(lags)[int(0.9 * len(lags))] * 1e3:7.1f} us", flush=True)
    print("event_wait_lag", json.dumps({"work_ms": args.work_ms, "cap_us": args.cap_us,
                                        "median_lag_us": out}))


if __name__ == "__main__":
    main()
