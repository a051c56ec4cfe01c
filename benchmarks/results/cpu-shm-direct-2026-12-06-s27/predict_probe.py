"""The planner's prediction of each direct_probe case (N tensors of S bytes, all read directly, R=1) on the
cpu-2core preset; KEY=VALUE arguments override links fields (e.g. software.control_us=200). meas: the medians of
direct_probe.txt (two runs each)."""
import dataclasses, sys
from weightsync.tools.planner.links import load_links
from weightsync.tools.planner.model import model_from_tensors
from weightsync.tools.planner.scenario import Scenario
from weightsync.tools.planner.predict import predict
over = dict(a.split("=") for a in sys.argv[1:])
over = {k: float(v) for k, v in over.items()}
meas = {(8,128):88.1,(64,16):121,(256,4):169,(512,2):214,(1024,1):319}
for (n, mib), m in meas.items():
    size = mib << 20
    model = model_from_tensors("probe", [(f"t{i}", (size // 2,)) for i in range(n)])
    links = load_links("cpu-2core", over)
    links = dataclasses.replace(links, direct_min_bytes=1 << 20)
    sc = Scenario(model=model, links=links, trainer_gpus=1, replicas=1, bucket_size=64 << 20,
                  src_dtype="bfloat16", dst_dtype="bfloat16", strategies=("ring",))
    p = predict(sc)
    r = p.results["ring"]
    t = float(r.seconds)
    print(n, mib, m, round(t*1e3,1), f"{t*1e3/m-1:+.0%}", r.bottleneck.name)
