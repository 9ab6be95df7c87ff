"""distributed.group_hosts: the host names of a group's ranks (gloo, two processes), which cuda_ep uses to keep
the symmetric-memory EP kernels to groups inside one host. Each rank reports the host name given to it."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init_file, names, out_dir):
    import socket

    from mok_nn import distributed

    socket.gethostname = lambda: names[rank]  # this process only: a rank "on" another host
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        first = distributed.group_hosts(dist.group.WORLD)
        second = distributed.group_hosts(dist.group.WORLD)  # cached: no second collective
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
            f.write(",".join(first) + "|" + ",".join(second))
        dist.barrier()  # no rank closes its connections while a peer still receives (gloo aborts)
    finally:
        dist.destroy_process_group()


def _hosts_seen(tmp_path, names):
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), names, str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return [(out / f"{r}.txt").read_text() for r in range(2)]


def test_two_hosts(tmp_path):
    assert _hosts_seen(tmp_path, ["node-b", "node-a"]) == ["node-a,node-b|node-a,node-b"] * 2


def test_one_host(tmp_path):
    assert _hosts_seen(tmp_path, ["node-a", "node-a"]) == ["node-a|node-a"] * 2
