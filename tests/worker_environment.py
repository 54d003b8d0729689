"""A rank that joins the job's default group, sums one value with every other rank, and writes what its
launcher told it (torchrun's worker environment) to DIR/rank-RANK.json; it prints one line naming its
local rank, so that a launcher's console filter can be seen.

    alpha-run --nnodes 2 --nproc 2 ... tests/worker_environment.py DIR
"""
import json
import os
import sys

import torch
import torch.distributed as dist

# torchrun's worker environment (torch.distributed.elastic.agent.server.local_elastic_agent).
VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def main(directory: str) -> None:
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    seen = {name: os.environ.get(name) for name in VARIABLES}
    seen["sum"] = int(total.item())
    with open(os.path.join(directory, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    print(f"local rank {os.environ['LOCAL_RANK']} of group {os.environ['GROUP_RANK']} joined", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
