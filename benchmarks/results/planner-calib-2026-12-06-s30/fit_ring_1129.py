"""Fit the H200 host costs of the ``cuda_ipc`` ring codes older than 12-04
(calibrate.RING_SOFTWARE_1129) to the 11-29 code's own H200 runs, and check them on the H200
run of the code of 12-01.

Fit rows: every counted calibration row of the four H200 runs of ``gpu-h200-2026-11-29``
(the code of 11-29), predicted with the run's ordering (``sync="host"`` rows: the trainer
waits for each pack, ``Scenario.ring_sync``, 1.35 times that copy alone:
``calibrate.OLD_PACK_WAIT_X``, the 11-29 code's H100 timeline). A first fit that waited for
each pack once (no ``pack_wait_x``) gave 48 us / 1080 us (``fit_ring_1129_wait1.txt``). Objective (``calibrate.ring_1129_loss``): the sum
of squared log(predicted / measured), each row once. Search: a grid of 5 us x 50 us, then
1 us x 10 us around its best. Check rows: the H200 run of ``gpu-h200-2026-12-01``. The H100
rows of both codes are priced with their own H100 timelines (``calibrate.ring_costs_old``),
not with these costs; the session-30 runs of this script (800 s and 1245 s) printed them
too, before ``ring_1129_loss`` predicted the H200 runs alone (ec0732b; faster since).

    .venv/bin/python benchmarks/results/planner-calib-2026-12-06-s30/fit_ring_1129.py
"""
import math

from weightsync.tools.planner import calibrate


def search(ts, bs) -> tuple[int, int]:
    seen = {(t, b): calibrate.ring_1129_loss(t, b)[0] for t in ts for b in bs}
    return min(seen, key=seen.get)


def fitted(r) -> bool:
    return calibrate.ring_code_of(r) == "11-29" and r["case"].startswith("H200 ")


def main() -> None:
    before = (48, 1080)        # the fit with the pack waited for once (no pack_wait_x)
    t0, b0 = search(range(30, 91, 5), range(500, 1601, 50))
    fit = search(range(t0 - 5, t0 + 6), range(b0 - 50, b0 + 51, 10))
    for label, (t, b) in (("before", before), ("fit", fit)):
        loss, rows = calibrate.ring_1129_loss(t, b)
        n = sum(map(fitted, rows))
        print(f"== {label}: tensor_us {t}, bucket_us {b}; {n} H200 rows of the code of 11-29, "
              f"rms log error {math.sqrt(loss / n):.3f}")
        for r in rows:
            tag = "fit  " if fitted(r) else "check" if r["case"].startswith("H200 ") else "h100 "
            print(f"{tag} {r['case']:100s} {r['predicted_s'] * 1e3:6.1f} "
                  f"{r['measured_s'] * 1e3:6.1f} {r['error'] * 100:+4.0f} %")


if __name__ == "__main__":
    main()
