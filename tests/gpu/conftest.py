"""GPU tests: skipped where CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def launched_kernels(monkeypatch):
    """The names of the kernels launched through the loaded library, in order (clear it between runs)."""
    from mok_nn import cuda_backend

    kernels = cuda_backend._lib()
    launch, launched = kernels.launch, []

    def recording_launch(name, *args, stream):
        launched.append(name)
        launch(name, *args, stream=stream)

    monkeypatch.setattr(kernels, "launch", recording_launch)
    return launched
