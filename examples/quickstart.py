"""weightsync quick start: a trainer process sends its model's weights to a rollout process.
Runs as is on CPU, with nothing to set up: python examples/quickstart.py"""
import multiprocessing as mp
import secrets
import socket

import torch

import weightsync


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 256))


def worker(role, address, token):
    # connect() joins the group; leaving the block calls engine.finalize()
    with weightsync.connect("shm", role=role, address=address, token=token, timeout=60) as engine:
        if role == "trainer":
            model = make_model(seed=0)                    # the freshly trained weights
            stats = engine.send(model.state_dict(), version=1)
        else:
            model = make_model(seed=1)                    # stale weights until the sync
            stats = engine.receive(into=model.state_dict(), version=1)
            want = make_model(seed=0).state_dict()
            assert all(torch.equal(t, want[name]) for name, t in model.state_dict().items())
        print(f"{role}: {stats}")


if __name__ == "__main__":
    with socket.socket() as s:                            # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    token = secrets.token_hex(16)                         # the job's shared secret
    procs = [mp.get_context("spawn").Process(target=worker, args=(r, address, token), daemon=True)
             for r in ("trainer", "rollout")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    ok = all(p.exitcode == 0 for p in procs)
    print("the rollout holds the trainer's weights" if ok else "the sync failed")
    raise SystemExit(0 if ok else 1)
