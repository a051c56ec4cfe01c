"""FSDP2 over ``nixl``: two ``fully_shard`` trainer ranks -> two receivers, exported as the
trainer mixin does (``export_weights(shards=True)``), default ``auto`` serving. Prints,
per rank and sync, the staging memory it holds (``held_bytes``), its share of the model,
the bytes each receiver pulled from it, whether the layout went out, and the send time;
then whether every receiver got each step's full weights (digests). The same processes as
``tests/test_nixl.py::test_an_fsdp2_model_is_served_from_its_own_shards_from_the_first_sync``.

    cd tests && ../.venv/bin/python ../benchmarks/nixl_fsdp2.py
"""

import sys

sys.path.insert(0, ".")

import test_nixl as t  # noqa: E402

if __name__ == "__main__":
    res = t._fsdp_group(t._digest_receiver, trainer=t._fsdp_model_trainer)
    for r, tr in enumerate(res[:2]):
        for s in tr["steps"]:
            print(f"trainer rank {r} version {s['version']}: held_bytes {s['held_bytes']}, "
                  f"its share {s['tensor_bytes']} B, served {s['served']}, "
                  f"layout_sent {s['layout_sent']}, {s['seconds']:.4f} s")
    print("every receiver got the trainer's full weights:",
          all(g == res[0]["digests"] for g in res[2:]))
