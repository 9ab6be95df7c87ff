"""mok_nn: a deterministic Mixture-of-Experts layer for PyTorch training."""

from .config import MoKConfig
from .layer import MoKMoELayer

__version__ = "0.1.0"

__all__ = ["MoKMoELayer", "MoKConfig", "__version__"]
