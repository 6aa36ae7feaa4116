"""GPU tests: run on a machine with a CUDA device, after building the extension with
CUDA (``pip install -e .`` or ``python setup.py build_ext --inplace``)::

    python -m pytest tests_gpu -q

They skip themselves where ``torch.cuda.is_available()`` is False (CI)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:  # an installed or in-place build is preferred; else the checkout's package
    import torch_kvops  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def cycles_per_ms():
    """torch.cuda._sleep cycles per millisecond on this GPU."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def pytest_collection_modifyitems(items):
    """Every test here needs a CUDA device: the ``gpu`` marker (docs/testing.md)."""
    for item in items:
        item.add_marker(pytest.mark.gpu)
