"""Run by the tests in two gloo processes (``torch.multiprocessing.spawn``): list the shards of each root
as training does and write, for each, what the process read to list them and what it got."""
from __future__ import annotations

import json
import os


def list_shards(rank: int, roots: list[str], port: str, out: str) -> None:
    import torch.distributed as dist

    from vitlab.config import load_config
    from vitlab.data import shards
    from vitlab.tasks.image_data import shard_streams

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    scanned: list[str] = []
    scan = shards._scan
    shards._scan = lambda url: scanned.append(url) or scan(url)  # what this process reads to list
    results = []
    for root in roots:
        scanned.clear()
        cfg = load_config(None, ["data.dataset=wds", f"data.root={root}", "data.loader=torch"])
        try:
            streams, classes = shard_streams(cfg.data, 0, (32, 32), 8, 2, rank)
            got = {"counts": [len(s.plan.segments) for s in streams.values()], "total": streams["train"].total,
                   "labels": streams["test"].labels.tolist(), "classes": classes}
        except Exception as e:  # noqa: BLE001 - the test compares the processes' errors
            got = {"error": f"{type(e).__name__}: {e}"}
        results.append({"scanned": len(scanned), **got})
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
