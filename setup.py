"""meshnet's one C extension; everything else about the package is in pyproject.toml.

``meshnet.backends._capture`` is a llama.cpp shard's eval callback in C (backends/eval_capture.py).
It is optional: where it does not build (no C compiler), shards run the same callback in Python,
slower by ~0.5 ms a decode step, and say so when they load.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshnet.backends._capture",
            sources=["src/meshnet/backends/_capture.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
