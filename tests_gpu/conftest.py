"""GPU tests: run on a machine with a CUDA device, after building the extension with
CUDA (``pip install -e .`` or ``python setup.py build_ext --inplace``)::

    python -m pytest tests_gpu -q

They skip themselves where ``torch.cuda.is_available()`` is False (CI)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:  # an installed or in-place build is preferred; else the checkout's package
    import torch_kvops  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)
