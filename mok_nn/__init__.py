"""mok_nn: a deterministic Mixture-of-Experts layer for PyTorch training."""

__version__ = "0.1.0"
