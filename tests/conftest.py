"""Without a GPU, Triton's interpreter runs mok_nn.triton_ops on CPU tensors (tests/test_triton_ops.py). The mode is
read when Triton's own library functions are defined, at Triton's first import, which another test's imports may
do (torchtitan's): so it is chosen here, before any test module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
