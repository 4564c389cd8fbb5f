"""Builds the native VMM page pool (allocator/) as harli_train._vmm; metadata lives in pyproject.toml."""

from setuptools import Extension, setup

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

setup(ext_modules=[vmm])
