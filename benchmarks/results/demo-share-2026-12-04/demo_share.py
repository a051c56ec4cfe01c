import sys
from weightsync.tools.demo import DemoOptions, run_demo
share = sys.argv[1] == "1"
opts = DemoOptions(steps=5, hidden=1024, layers=8, vocab=32000, share_memory=share, timeout=300)
run_demo(opts, out=lambda l: print(l, flush=True))
