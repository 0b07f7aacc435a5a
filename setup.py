"""Build glue for the private native module `tidekv._native` (C++17, pybind11).

Everything else lives in pyproject.toml; setuptools needs code to describe an extension.
"""
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("TIDEKV_BUILD_JOBS", default=0).install()

native = Pybind11Extension(
    "tidekv._native",
    sorted(glob("native/**/*.cpp", recursive=True)),
    include_dirs=["native"],
    cxx_std=17,
    extra_compile_args=["-O2", "-g0", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread", "-ldl"]  # -ldl: dlopen of libcuda on glibc < 2.34,
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
