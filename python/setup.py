"""Builds expert_cache_torch (the PyTorch extension) with torch.utils.cpp_extension.

    pip install --no-build-isolation ./python          # from the repository root
    cd python && python setup.py build_ext --inplace    # in place, for python/tests

TORCH_CUDA_ARCH_LIST picks the GPU architectures (e.g. 9.0 for H100/H200); MAX_JOBS the parallel
compiles. The library headers come from ../include (header-only, nothing to link).
"""
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.normpath(os.path.join(HERE, "..", "include"))
if not os.path.isfile(os.path.join(INCLUDE, "expert_cache", "any/any_cache.hpp")):
    raise SystemExit(f"expert_cache headers not found at {INCLUDE} (build from a checkout of the repository)")

# C++20 for both compilers (the library needs it; cpp_extension adds its own -std only when none is given).
CXX_FLAGS = ["-std=c++20", "-O2"]
NVCC_FLAGS = ["-std=c++20", "-O2", "--expt-relaxed-constexpr"]

setup(
    name="expert_cache_torch",
    version="0.1.0",
    description="expert_cache: a GPU expert cache for Mixture-of-Experts inference, for PyTorch",
    packages=["expert_cache_torch"],
    ext_modules=[
        CUDAExtension(
            "expert_cache_torch._C",
            # Paths relative to this file (setuptools wants them relative to setup.py).
            ["src/extension.cpp", "src/bridge_cuda.cu"],
            include_dirs=[INCLUDE, os.path.join(HERE, "src")],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
