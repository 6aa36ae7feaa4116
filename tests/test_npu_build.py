"""How the Ascend backend binds ACL, read from the NPU build of the extension that
scripts/check_npu_build.sh compiles and links against the real torch_npu 2.13.0 wheel (no
CANN or NPU needed). The build is cached in .npu-check/: ~2 s when csrc/ is unchanged,
~2 min of compilation on 2 cores after a change (plus a 44 MB download on a fresh checkout).

An ACL entry point that libtorch_npu.so does not import directly may be missing from a CANN
that torch_npu supports. Linked directly, it would make `import torch_kvops` fail with an
undefined symbol there instead of taking its fallback, so it must be looked up at run time
(csrc/npu/acl_binding.h)."""
import glob
import os
import subprocess
from dataclasses import dataclass

import pytest

pytestmark = [pytest.mark.process, pytest.mark.build]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, ".npu-check", "build")

# Looked up at run time, each with a fallback (docs/npu.md, "Linkage").
RESOLVED_AT_RUN_TIME = [
    "aclrtMemcpyBatchAsync",           # -> one aclrtMemcpyAsync per copy
    "aclrtQueryEventStatus",           # -> aclrtCreateEvent events + aclrtQueryEvent
    "aclrtQueryEvent",
    "aclrtCreateEvent",
    "aclmdlRICaptureGetInfo",          # -> no capture on that CANN
    "aclmdlRICaptureThreadExchangeMode",
    "aclrtPointerGetAttributes",       # -> .ptrs copies host memory only
    "aclGetRecentErrMsg",              # -> error messages without ACL's text
]
# Linked directly: libtorch_npu.so 2.13 imports each of them directly too.
LINKED = ["aclrtMemcpyAsync", "aclrtCreateEventExWithFlag", "aclrtRecordEvent", "aclrtDestroyEvent"]


@dataclass
class NpuBuild:
    extension: str     # the linked _C*.so
    acl_stub_dir: str  # the link-time libascendcl.so stand-in
    torch_npu: str     # the wheel's libtorch_npu.so


@pytest.fixture(scope="module")
def npu_build() -> NpuBuild:
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_npu_build.sh")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (
        f"scripts/check_npu_build.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    built = glob.glob(os.path.join(BUILD, "_C*.so"))
    assert len(built) == 1, f"expected one extension in {BUILD}, found {built}"
    build = NpuBuild(built[0], os.path.join(BUILD, "acl-stub"),
                     os.path.join(BUILD, "libtorch_npu.so"))
    for path in (os.path.join(build.acl_stub_dir, "libascendcl.so"), build.torch_npu):
        assert os.path.exists(path), f"the NPU check left no {path}"
    return build


def acl_imports(shared_object: str) -> set[str]:
    """ACL functions the shared object imports (undefined dynamic symbols acl*)."""
    out = subprocess.run(["nm", "-D", "--undefined-only", shared_object], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith("acl")}


def names_in(shared_object: str) -> set[str]:
    """Every printable string of the shared object (the names dlsym is given)."""
    out = subprocess.run(["strings", "-a", shared_object], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return set(out.split())


def linkage_problems(shared_object: str, torch_npu: str) -> list[str]:
    imports = acl_imports(shared_object)
    torch_npu_imports = acl_imports(torch_npu)
    strings = names_in(shared_object)
    problems = [f"{n} is linked directly (must be resolved at run time)"
                for n in RESOLVED_AT_RUN_TIME if n in imports]
    problems += [f"{n} is never looked up by name"
                 for n in RESOLVED_AT_RUN_TIME if n not in strings]
    problems += [f"{n} is not linked directly" for n in LINKED if n not in imports]
    problems += [f"{n} is linked but libtorch_npu.so does not import it directly"
                 for n in sorted(imports - torch_npu_imports)]
    return problems


def test_optional_acl_entry_points_are_resolved_at_run_time_required_ones_linked(npu_build):
    assert linkage_problems(npu_build.extension, npu_build.torch_npu) == []


def test_the_split_follows_torch_npus_own_imports(npu_build):
    """The lists above follow libtorch_npu.so: a torch_npu that starts linking an optional
    entry point (or stops linking a required one) shows up here."""
    torch_npu_imports = acl_imports(npu_build.torch_npu)
    assert set(LINKED) <= torch_npu_imports
    assert not set(RESOLVED_AT_RUN_TIME) & torch_npu_imports


def test_a_direct_call_of_an_optional_entry_point_is_caught(npu_build, tmp_path):
    """Negative control: a library that calls aclrtMemcpyBatchAsync directly, linked
    against the same stand-in for libascendcl.so, is reported."""
    src = tmp_path / "direct.c"
    src.write_text("int aclrtMemcpyBatchAsync(void);\n"
                   "int aclrtMemcpyAsync(void);\n"
                   "int copy(void) { return aclrtMemcpyBatchAsync() + aclrtMemcpyAsync(); }\n")
    sabotaged = tmp_path / "libdirect.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(sabotaged), str(src),
                    f"-L{npu_build.acl_stub_dir}", "-lascendcl"], check=True, timeout=120)
    problems = linkage_problems(str(sabotaged), npu_build.torch_npu)
    assert "aclrtMemcpyBatchAsync is linked directly (must be resolved at run time)" in problems
    assert ("aclrtMemcpyBatchAsync is linked but libtorch_npu.so does not import it directly"
            in problems)
    assert "aclrtMemcpyAsync is linked directly (must be resolved at run time)" not in problems
