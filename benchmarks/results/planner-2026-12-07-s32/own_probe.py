"""Count with each listed machine's runs priced with its own probe (session 32 experiment)."""
import sys
from weightsync.tools.planner import calibrate as c
c.OWN_PROBE_RUNS = frozenset(sys.argv[1:])
doc = c.run()
txt = c.format_text(doc)
print([l for l in txt.splitlines() if "within +-25 %" in l and "by case" in l][-1][:260])
start = False
for line in txt.splitlines():
    if line.startswith("repeats ("):
        start = True
    if start and "% **no**" in line:
        print(line[:300])
