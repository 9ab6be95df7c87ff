"""mok_nn: a deterministic Mixture-of-Experts layer for PyTorch training."""

import os as _os

from .config import MoKConfig
from .layer import MoKMoELayer

__version__ = "0.1.0"

__all__ = ["MoKMoELayer", "MoKConfig", "__version__"]

# The top-level `integrations/` folder installs as `mok_nn.integrations`. When
# mok_nn is imported from a source checkout (PYTHONPATH=.), let the import
# system find it there too, so the checkout works without an install.
_checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout_root, "integrations", "__init__.py")) and not _os.path.isdir(
    _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "integrations")
):
    __path__.append(_checkout_root)  # noqa: F821 (module attribute of a package)
