"""Builds the codec's C kernels; all other metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "ray_checkfreq.codec._kernels", ["ray_checkfreq/codec/_kernels.c"],
    extra_compile_args=["-O3", "-std=c11"])])
