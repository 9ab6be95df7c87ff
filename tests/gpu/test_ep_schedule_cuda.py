"""cuda_ep.make_ep_schedule on a CUDA device (no kernels of ours: torch's sort / searchsorted / gathers
on the GPU) gives the bits of the previous construction (the oracle kept in
tests/test_cuda_ep_schedule_equiv.py), also on the GPU, and of itself on the CPU; qwen3-sized and
small random routings, overflow and empty ranks included. One GPU, a few seconds."""

import importlib.util
import pathlib

import pytest
import torch

from mok_nn import cuda_ep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_spec = importlib.util.spec_from_file_location(
    "ep_sched_equiv", pathlib.Path(__file__).resolve().parents[1] / "test_cuda_ep_schedule_equiv.py")
equiv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(equiv)


@pytest.mark.parametrize("ep_size,tc,top_k,e_l,mult,trials", [
    (2, 8192, 8, 64, 2.0, 2),   # qwen3-30b-a3b at EP=2, the benchmark shape
    (2, 8192, 8, 64, 1.0, 2),
    (4, 2048, 8, 32, 0.1, 2),   # overflows
    (2, 300, 2, 4, 1.0, 10),
    (4, 100, 4, 3, 4.0, 10),
])
def test_cuda_schedule_bitwise(ep_size, tc, top_k, e_l, mult, trials):
    gen = torch.Generator().manual_seed(tc + ep_size)
    for trial in range(trials):
        ids_all, tokens = equiv._random_ids(gen, ep_size, tc, top_k, e_l * ep_size)
        cap = cuda_ep.schedule_capacity(tc, top_k, e_l, ep_size, mult)
        ids_gpu = ids_all.cuda()
        for rank in range(ep_size):
            new = equiv._fields(cuda_ep.make_ep_schedule(ids_gpu, tokens[rank], rank, e_l, cap))
            old = equiv._fields(equiv._make_ep_schedule_old(ids_gpu, tokens[rank], rank, e_l, cap))
            cpu = equiv._fields(cuda_ep.make_ep_schedule(ids_all, tokens[rank], rank, e_l, cap))
            for name in old:
                assert new[name].is_cuda and new[name].dtype == old[name].dtype, (trial, rank, name)
                assert torch.equal(new[name], old[name]), (trial, rank, name, "vs old on the GPU")
                assert torch.equal(new[name].cpu(), cpu[name]), (trial, rank, name, "vs new on the CPU")
