"""Builds torch_kvops._C: CPU sources always, CUDA when torch has CUDA and nvcc is
found, NPU when torch_npu and the CANN toolkit are found."""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(*patterns):
    return sorted(p for pat in patterns for p in glob.glob(os.path.join("csrc", pat)))


def cuda_available():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if os.environ.get("KVOPS_DISABLE_CUDA") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None and (
        shutil.which("nvcc") or os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")))


def npu_available():
    if os.environ.get("KVOPS_DISABLE_NPU") == "1":
        return False
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH"))


def openmp_flags():
    """at::parallel_for is a header template: its `#pragma omp parallel` is compiled into
    this extension, and without -fopenmp it silently runs on one thread (the CPU copy
    then ignores torch.get_num_threads()). Linking -fopenmp adds NEEDED libgomp.so.1,
    which resolves to the libgomp torch already loaded (same soname): one thread pool."""
    if os.environ.get("KVOPS_DISABLE_OPENMP") == "1" or not sys.platform.startswith("linux"):
        return [], []
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return [], []
    return ["-fopenmp"], ["-fopenmp"]


def make_extension():
    srcs = sources("torch_bindings.cpp", "core/*.cpp", "cpu/*.cpp")
    omp_compile, omp_link = openmp_flags()
    cxx = ["-O3"] + omp_compile
    macros = []
    with_cuda, with_npu = cuda_available(), npu_available()
    macros.append(("KVOPS_WITH_CUDA", "1" if with_cuda else "0"))
    macros.append(("KVOPS_WITH_NPU", "1" if with_npu else "0"))
    if with_npu:
        import torch_npu

        ascend = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ["ASCEND_HOME_PATH"]
        npu_root = os.path.dirname(torch_npu.__file__)
        npu_include = os.path.join(npu_root, "include")
        srcs += sources("npu/*.cpp")
        # torch_npu's include/ only, as its own NpuExtension does: its bundled ACL headers
        # are the ones torch_npu was built with. ACL entry points that libtorch_npu.so does
        # not import directly are resolved at run time (csrc/npu/acl_binding.h); the toolkit
        # only provides libascendcl.so. scripts/check_npu_build.sh compiles the same way.
        return CppExtension(
            "torch_kvops._C", srcs, define_macros=macros,
            include_dirs=[npu_include, os.path.join(npu_include, "third_party", "hccl", "inc")],
            library_dirs=[os.path.join(ascend, "lib64"), os.path.join(npu_root, "lib")],
            libraries=["ascendcl", "torch_npu", "dl"], extra_compile_args={"cxx": cxx},
            extra_link_args=omp_link)
    if with_cuda:
        srcs += sources("cuda/*.cu")
        return CUDAExtension(
            "torch_kvops._C", srcs, define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]}, extra_link_args=omp_link)
    return CppExtension("torch_kvops._C", srcs, define_macros=macros,
                        extra_compile_args={"cxx": cxx}, extra_link_args=omp_link)


def requirements():
    """The compiled extension is tied to the torch it was built against (C++ ABI,
    dispatcher symbols): pin that release, whatever its local tag (+cpu, +cu130)."""
    import torch

    return [f"torch=={torch.__version__.split('+')[0]}", "numpy"]


# Name, version and extras: pyproject.toml. Every package under torch_kvops/ is found
# (tests/test_packaging.py checks that each has an __init__.py, so none is left out).
setup(
    packages=find_packages(include=["torch_kvops", "torch_kvops.*"]),
    install_requires=requirements(),
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtension},
)
