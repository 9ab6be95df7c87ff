"""A process that used an expert-parallel group exits cleanly after destroying it: mok_nn's cached workspaces (which
hold their group) are dropped at exit while the interpreter is whole. A gloo ProcessGroup first freed during
interpreter shutdown can abort the process ("terminate called without an active exception"), now and then: this
checks the cause deterministically, in a child process whose own exit handler, registered before mok_nn's and so
run after it, reports whether the group is still alive."""

import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import atexit, datetime, gc, sys, weakref
    import torch
    import torch.distributed as dist

    state = {}

    def report():  # registered first: runs after mok_nn's handlers
        gc.collect()
        print("group alive at exit:", state["group"]() is not None, flush=True)

    atexit.register(report)
    from mok_nn import MoKMoELayer

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group([0])
    torch.manual_seed(0)
    layer = MoKMoELayer(16, 8, 4, 2, backend="torch", ep_group=group)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    state["group"] = weakref.ref(group)
    dist.destroy_process_group()
    del layer, group
    gc.collect()
    print("group alive before exit:", state["group"]() is not None, flush=True)
""")


def test_the_workspaces_let_their_group_go_at_exit(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # the workspace still holds the group after the user dropped theirs (it lives until release_workspaces) ...
    assert "group alive before exit: True" in done.stdout, done.stdout
    # ... and lets it go at exit, before the interpreter's teardown
    assert "group alive at exit: False" in done.stdout, done.stdout
