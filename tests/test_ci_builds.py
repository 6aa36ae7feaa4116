"""The wheel check and the CUDA backend's compile-and-link check (``make wheel-check``,
``make cuda-check``: scripts/check_wheel.sh, scripts/check_cuda_build.sh), run by the
suite, so that they build beside the big fleets instead of after the suite (CI's 90
minutes: they took ~3.5 min one after another there). Each fails with its script's
output; the NPU check runs in tests/test_npu_build.py, which reads its build."""
import os
import subprocess

import pytest

pytestmark = [pytest.mark.process, pytest.mark.build]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("target", ["wheel-check", "cuda-check"])
def test_the_build_check_passes(target):
    proc = subprocess.run(["make", "--no-print-directory", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, f"make {target} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
