"""The native extension, kvstore._native; everything else is in pyproject.toml.

It is optional: where it cannot be built (no C compiler, no Python headers) the
install still succeeds and kvstore runs its pure-Python twins (kvstore/accel.py),
slower. `kvstore info` and the benchmarks say which one is in use.
"""

from setuptools import Extension, setup

# Built with baseline flags, so the module runs on any CPU of its architecture; the
# SHA-NI and AVX2 paths are picked at import from what the CPU has.
sources = ["kvstore/csrc/module.c", "kvstore/csrc/sha256.c", "kvstore/csrc/copies.c"]

setup(
    ext_modules=[
        Extension(
            "kvstore._native",
            sources=sources,
            include_dirs=["kvstore/csrc", "kvstore/csrc/vendor/xxhash"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
