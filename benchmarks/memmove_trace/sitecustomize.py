"""Times every ``ctypes.memmove`` of a process (the CPU data path's copies, see
``weightsync.transport.fastcopy``) and writes them at exit to
``$WEIGHTSYNC_MEMMOVE_TRACE/<pid>.json`` as ``[start, end, bytes, thread]`` (perf_counter).
Loaded by putting this folder first on ``PYTHONPATH``; read with
``benchmarks/memmove_timeline.py``. A measuring aid, not part of weightsync."""
import atexit
import ctypes
import json
import os
import threading
import time

_OUT = os.environ.get("WEIGHTSYNC_MEMMOVE_TRACE")
if _OUT:
    _orig, _log = ctypes.memmove, []

    def _timed(dst, src, n):
        t0 = time.perf_counter()
        r = _orig(dst, src, n)
        _log.append((t0, time.perf_counter(), int(n), threading.get_ident()))
        return r

    ctypes.memmove = _timed

    @atexit.register
    def _dump() -> None:
        if _log:
            os.makedirs(_OUT, exist_ok=True)
            with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
                json.dump(_log, f)
