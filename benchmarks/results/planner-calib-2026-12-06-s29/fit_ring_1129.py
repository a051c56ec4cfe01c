"""Fit the host costs of the ``cuda_ipc`` ring code of 11-29 (calibrate.RING_SOFTWARE_1129)
to that code's own runs, and check them on the runs of the code of 12-01.

Fit rows: every counted calibration row of the code of 11-29 (the four H200 runs of
``gpu-h200-2026-11-29`` and the ``c1129`` H100 runs of ``gpu-h100-2026-12-06-s26``).
Objective (``calibrate.ring_1129_loss``): the sum of squared log(predicted / measured), each
row once. Search: a grid of 5 us x 50 us, then 1 us x 10 us around its best. Check rows: the
code of 12-01 (the H200 run of ``gpu-h200-2026-12-01`` and the ``c1201`` H100 runs), not
used by the fit. About 8 minutes on this box.

    .venv/bin/python benchmarks/results/planner-calib-2026-12-06-s29/fit_ring_1129.py
"""
import math

from weightsync.tools.planner import calibrate


def search(ts, bs) -> tuple[int, int]:
    seen = {(t, b): calibrate.ring_1129_loss(t, b)[0] for t in ts for b in bs}
    return min(seen, key=seen.get)


def main() -> None:
    before = (70, 930)        # the costs until session 29
    t0, b0 = search(range(30, 91, 5), range(500, 1601, 50))
    fit = search(range(t0 - 5, t0 + 6), range(b0 - 50, b0 + 51, 10))
    for label, (t, b) in (("before", before), ("fit", fit)):
        loss, rows = calibrate.ring_1129_loss(t, b)
        n = sum(calibrate.ring_code_of(r) == "11-29" for r in rows)
        print(f"== {label}: tensor_us {t}, bucket_us {b}; {n} rows of the code of 11-29, "
              f"rms log error {math.sqrt(loss / n):.3f}")
        for r in rows:
            tag = "fit  " if calibrate.ring_code_of(r) == "11-29" else "check"
            print(f"{tag} {r['case']:100s} {r['predicted_s'] * 1e3:6.1f} "
                  f"{r['measured_s'] * 1e3:6.1f} {r['error'] * 100:+4.0f} %")


if __name__ == "__main__":
    main()
