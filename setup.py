"""Builds the native VMM page pool (allocator/) as harli_train._vmm; metadata lives in pyproject.toml.

On Linux the pool is part of every install (co-located runs share it between the KV cache and the
trainer), so a missing C++ compiler stops the install with a message that says what to install. Elsewhere
the library is not built (it needs Linux's memfd and the CUDA driver's VMM); co-located runs then say so.
"""

import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

vmm = Extension(
    "harli_train._vmm",
    sources=[
        "allocator/module.cpp",
        "allocator/c_api.cpp",
        "allocator/pool.cpp",
        "allocator/backend_cuda.cpp",
        "allocator/backend_host.cpp",
    ],
    depends=["allocator/hvmm.h", "allocator/backend.h", "allocator/pool.h"],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["dl"],
)

NO_COMPILER = (
    "harli-train: no C++ compiler found to build its page pool (allocator/*.cpp, C++17): install one "
    "(e.g. `apt-get install g++`, or `dnf install gcc-c++`) or point CXX at it, then install again"
)


class BuildVMM(build_ext):
    """build_ext that names the missing compiler instead of failing deep inside distutils."""

    def build_extensions(self) -> None:
        compiler = getattr(self.compiler, "compiler_cxx", None) or getattr(self.compiler, "compiler_so", None)
        exe = compiler[0] if compiler else "c++"
        if shutil.which(exe) is None:
            raise SystemExit(f"{NO_COMPILER} (looked for {exe!r} on PATH)")
        super().build_extensions()


setup(ext_modules=[vmm] if sys.platform.startswith("linux") else [], cmdclass={"build_ext": BuildVMM})
