"""Build of the specmoe._C extension (CPython + NumPy C API, no pybind).

Environment knobs:
  SPECMOE_WERROR=1        add -Werror (CI and `make test` builds use it)
  SPECMOE_SANITIZE=thread|address   instrument the extension (see Makefile test-sanitize)
  SPECMOE_DEBUG=1         -O0 -g
  SPECMOE_CUDA=1          also compile cuda/*.cu with nvcc (only where nvcc is found)
"""
import glob
import os
import shutil
import sys

import numpy as np
from setuptools import Extension, setup

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(
    os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "**", "*.c"), recursive=True)
)
# a header change recompiles every source (setuptools compares only .c times otherwise)
headers = sorted(
    os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "**", "*.h"), recursive=True)
)
cflags = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread", "-D_GNU_SOURCE"]
ldflags = ["-pthread"]
if os.environ.get("SPECMOE_DEBUG") == "1":
    cflags += ["-O0", "-g"]
else:
    cflags += ["-O3"]
if os.environ.get("SPECMOE_WERROR") == "1":
    cflags.append("-Werror")
san = os.environ.get("SPECMOE_SANITIZE")
if san:
    cflags += [f"-fsanitize={san}", "-g", "-fno-omit-frame-pointer"]
    ldflags += [f"-fsanitize={san}"]

if os.environ.get("SPECMOE_CUDA") == "1":
    if shutil.which("nvcc") is None:
        sys.exit("SPECMOE_CUDA=1 but nvcc was not found on PATH")
    if not glob.glob(os.path.join(here, "cuda", "*.cu")):
        print("SPECMOE_CUDA=1: cuda/ has no sources yet; building the CPU extension only")

setup(
    ext_modules=[
        Extension(
            "specmoe._C",
            sources=sources,
            depends=headers,
            include_dirs=[np.get_include(), "csrc"],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ]
)
