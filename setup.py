"""Build of the specmoe._C extension (CPython + NumPy C API, no pybind) and, where a CUDA
toolkit is found, of the separate specmoe._cuda extension (cuda/: GPU kernels and the GPU
cache).  specmoe._C never links CUDA, so `import specmoe` works on any machine; specmoe._cuda
is imported lazily by specmoe.runtime.cuda.

Environment knobs:
  SPECMOE_WERROR=1        add -Werror (CI and `make test` builds use it); for nvcc also
                          `-Werror all-warnings` and -Werror for the host compiler
  SPECMOE_SANITIZE=thread|address   instrument the extension (see Makefile test-sanitize)
  SPECMOE_DEBUG=1         -O0 -g
  SPECMOE_CUDA=1          build specmoe._cuda; fail when no usable toolkit is found
  SPECMOE_CUDA=0          never build specmoe._cuda
  (unset)                 build specmoe._cuda when a usable toolkit is found, else skip it
  SPECMOE_NVCC=path       the nvcc to use (default: CUDA_HOME/bin/nvcc, then the
                          nvidia-cuda-nvcc wheel of this interpreter, then nvcc on PATH)
  SPECMOE_CUDA_ARCH="80;90"  compute capabilities: SASS for each, PTX for the lowest
  SPECMOE_JOBS=N          compile N C sources at a time (default: one per CPU)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_clib import build_clib
from setuptools.command.build_ext import build_ext

here = os.path.dirname(os.path.abspath(__file__))


def rel(paths):
    return sorted(os.path.relpath(p, here) for p in paths)


sources = rel(glob.glob(os.path.join(here, "csrc", "**", "*.c"), recursive=True))
# a header change recompiles every source (setuptools compares only .c times otherwise)
headers = rel(glob.glob(os.path.join(here, "csrc", "**", "*.h"), recursive=True))


def _binding(path):
    """The CPython bindings: every file under csrc/bindings/ (they include Python.h; the rest
    of csrc/ does not)."""
    return path.startswith(os.path.join("csrc", "bindings") + os.sep)


# the GPU module's binding (built into specmoe._cuda with cuda/*.c, never into specmoe._C)
CUDA_BINDING = os.path.join("csrc", "bindings", "py_cuda.c")
# binding code both extensions use (the expert-descriptor parser, the Python-policy bridge):
# compiled once into the static library smoe_pybind, like the core
SHARED_BINDING = [os.path.join("csrc", "bindings", "py_desc.c"),
                  os.path.join("csrc", "bindings", "py_bridge.c")]
# The pure-C core (no Python.h): slots, cache, store, policies, kernels, MoE layers, simulator,
# speculation controllers.  Compiled once into the static library smoe_core (build_clib),
# which specmoe._C and specmoe._cuda both link: no C source is compiled into two extensions.
core_sources = [s for s in sources if not _binding(s)]
binding_sources = [s for s in sources
                   if _binding(s) and s != CUDA_BINDING and s not in SHARED_BINDING]
cflags = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread", "-D_GNU_SOURCE"]
ldflags = ["-pthread"]
if os.environ.get("SPECMOE_DEBUG") == "1":
    cflags += ["-O0", "-g"]
else:
    cflags += ["-O3"]
werror = os.environ.get("SPECMOE_WERROR") == "1"
if werror:
    cflags.append("-Werror")
san = os.environ.get("SPECMOE_SANITIZE")
if san:
    cflags += [f"-fsanitize={san}", "-g", "-fno-omit-frame-pointer"]
    ldflags += [f"-fsanitize={san}"]

core_lib = ("smoe_core", {"sources": core_sources, "include_dirs": ["csrc"], "cflags": cflags,
                         "depends": headers})
pybind_lib = ("smoe_pybind", {"sources": SHARED_BINDING, "cflags": cflags, "depends": headers,
                              "include_dirs": ["csrc", "csrc/bindings",
                                               sysconfig.get_paths()["include"]]})

ext_modules = [
    Extension(
        "specmoe._C",
        sources=binding_sources,
        depends=headers + core_sources,  # relinked when the core library changed
        include_dirs=[np.get_include(), "csrc"],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )
]


# ---- CUDA toolkit discovery ----------------------------------------------------------------

def _wheel_roots():
    """nvidia/cu13 and nvidia/cu12 folders of the pip wheels (nvidia-cuda-nvcc, -runtime,
    -cublas, -cccl) visible to this interpreter, newest CUDA first."""
    roots = []
    for entry in sys.path:
        for tag in ("cu13", "cu12"):
            d = os.path.join(entry or ".", "nvidia", tag)
            if os.path.isdir(d) and os.path.abspath(d) not in roots:
                roots.append(os.path.abspath(d))
    # the cu12 wheels put each component in its own folder (nvidia/cuda_runtime, nvidia/cublas)
    for entry in sys.path:
        for comp in ("cuda_nvcc", "cuda_runtime", "cublas", "cuda_cccl"):
            d = os.path.join(entry or ".", "nvidia", comp)
            if os.path.isdir(d) and os.path.abspath(d) not in roots:
                roots.append(os.path.abspath(d))
    return roots


def _find_nvcc():
    explicit = os.environ.get("SPECMOE_NVCC")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    for root in _wheel_roots():
        p = os.path.join(root, "bin", "nvcc")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("nvcc")


def _toolkit_dirs(nvcc):
    """(include dirs, library dirs) of the toolkit around nvcc plus the wheels' folders."""
    cands = []
    real = os.path.realpath(nvcc)
    for p in (nvcc, real):
        top = os.path.dirname(os.path.dirname(p))
        if top not in cands:
            cands.append(top)
    cands += [r for r in _wheel_roots() if r not in cands]
    inc, lib = [], []
    for top in cands:
        for d in (os.path.join(top, "include"), os.path.join(top, "targets", "x86_64-linux", "include")):
            if os.path.isdir(d) and d not in inc:
                inc.append(d)
            if os.path.isdir(os.path.join(d, "cccl")) and os.path.join(d, "cccl") not in inc:
                inc.append(os.path.join(d, "cccl"))
        for d in (os.path.join(top, "lib64"), os.path.join(top, "lib"),
                  os.path.join(top, "targets", "x86_64-linux", "lib")):
            if os.path.isdir(d) and d not in lib:
                lib.append(d)
    return inc, lib


def _have(dirs, name):
    return any(os.path.exists(os.path.join(d, name)) for d in dirs)


def _cublas_lib(libdirs):
    """Linker argument for cuBLAS: -lcublas where the unversioned name exists, else the
    versioned soname (the wheels ship only libcublas.so.NN)."""
    for d in libdirs:
        if os.path.exists(os.path.join(d, "libcublas.so")):
            return "-lcublas"
    for d in libdirs:
        for so in sorted(glob.glob(os.path.join(d, "libcublas.so.[0-9]*"))):
            base = os.path.basename(so)
            if base.count(".") == 2:  # libcublas.so.13, not libcublas.so.13.0.2
                return f"-l:{base}"
    return None


def _cuda_plan():
    """The CUDA build settings, or (None, reason) when specmoe._cuda is not built."""
    want = os.environ.get("SPECMOE_CUDA", "")
    if want == "0":
        return None, "SPECMOE_CUDA=0"
    cu_sources = rel(glob.glob(os.path.join(here, "cuda", "*.cu")))
    if not cu_sources:
        return None, "cuda/ has no .cu sources"
    nvcc = _find_nvcc()
    if nvcc is None:
        return None, "no nvcc found (SPECMOE_NVCC, CUDA_HOME, the nvidia-cuda-nvcc wheel, PATH)"
    inc, lib = _toolkit_dirs(nvcc)
    missing = [h for h in ("cuda_runtime_api.h", "cublas_v2.h", "nv/target") if not _have(inc, h)]
    if missing:
        return None, f"nvcc {nvcc} found but not the headers {missing} (include dirs {inc})"
    if not _have(lib, "libcudart_static.a"):
        return None, f"no libcudart_static.a in {lib}"
    cublas = _cublas_lib(lib)
    if cublas is None:
        return None, f"no libcublas.so* in {lib}"
    return {"nvcc": nvcc, "inc": inc, "lib": lib, "cublas": cublas, "cu": cu_sources}, ""


def _compile_in_parallel(compiler, jobs):
    """Make ``compiler.compile`` build its sources on ``jobs`` threads (each source is its own
    compiler process; setuptools runs them one after another).  Uses the compile steps of
    distutils' CCompiler.compile itself (_setup_compile, _get_cc_args, _compile)."""
    from concurrent.futures import ThreadPoolExecutor

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, [o for o in objects if o in build]))  # re-raises a failure
        return objects
    compiler.compile = compile


def _stale(target, deps):
    """Whether ``target`` is missing or older than any of ``deps``."""
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(d) > t for d in deps)


class BuildClib(build_clib):
    """build_clib that rebuilds a library only when one of its sources or headers is newer
    (setuptools recompiles every source each time), compiling in parallel like BuildExt."""

    def build_libraries(self, libraries):
        jobs = int(os.environ.get("SPECMOE_JOBS") or os.cpu_count() or 1)
        if jobs > 1:
            _compile_in_parallel(self.compiler, jobs)
        for name, info in libraries:
            out = self.compiler.library_filename(name, output_dir=self.build_clib)
            if self.force or _stale(out, list(info["sources"]) + list(info.get("depends", ()))):
                super().build_libraries([(name, info)])


class BuildExt(build_ext):
    """build_ext that compiles cuda/*.cu with nvcc into objects linked into specmoe._cuda
    (static CUDA runtime; cuBLAS dynamic, preloaded by specmoe.runtime.cuda before the import), and
    the C sources of each extension in parallel, one job per CPU (SPECMOE_JOBS=N sets it)."""

    def run(self):
        # `build` runs build_clib first, `build_ext --inplace` (make build, pip install -e)
        # does not: the core library is built here either way (a no-op when up to date)
        self.run_command("build_clib")
        super().run()

    def build_extensions(self):
        jobs = int(os.environ.get("SPECMOE_JOBS") or os.cpu_count() or 1)
        if jobs > 1:
            _compile_in_parallel(self.compiler, jobs)
        super().build_extensions()

    def build_extension(self, ext):
        cu = getattr(ext, "cu_sources", None)
        if cu:
            plan = ext.cuda_plan
            objs = []
            tmp = os.path.join(self.build_temp, "cuda")
            os.makedirs(tmp, exist_ok=True)
            archs = [a.strip() for a in os.environ.get("SPECMOE_CUDA_ARCH", "80;90").split(";") if a.strip()]
            gencode = []
            for a in archs:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            gencode += ["-gencode", f"arch=compute_{archs[0]},code=compute_{archs[0]}"]
            host = ["-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]
            flags = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Icsrc", "-Icuda"]
            flags += [f"-I{d}" for d in plan["inc"]]
            if werror:
                flags += ["-Werror", "all-warnings"]
                host.append("-Werror")
            flags += ["-Xcompiler", ",".join(host)]
            for src in cu:
                obj = os.path.join(tmp, os.path.splitext(os.path.basename(src))[0] + ".o")
                deps = [src] + glob.glob(os.path.join(here, "cuda", "*.h")) + headers
                if (not self.force and os.path.exists(obj)
                        and all(os.path.getmtime(obj) >= os.path.getmtime(d) for d in deps)):
                    objs.append(obj)
                    continue
                cmd = [plan["nvcc"], "-c", src, "-o", obj] + gencode + flags
                print(" ".join(cmd))
                subprocess.check_call(cmd)
                objs.append(obj)
            ext.extra_objects = objs
        super().build_extension(ext)


plan, why = _cuda_plan()
if plan is None:
    if os.environ.get("SPECMOE_CUDA") == "1":
        sys.exit(f"SPECMOE_CUDA=1 but specmoe._cuda cannot be built: {why}")
    if "build_ext" in sys.argv or "develop" in sys.argv or "editable_wheel" in sys.argv:
        print(f"specmoe._cuda not built: {why}")
else:
    # The GPU module links the same core library as specmoe._C (the slot table, store reads,
    # policies, descriptor checks): its own copy at run time, compiled once.
    cuda_c = rel(glob.glob(os.path.join(here, "cuda", "*.c"))) + [CUDA_BINDING]
    cuda_ext = Extension(
        "specmoe._cuda",
        sources=cuda_c,
        depends=headers + core_sources + rel(glob.glob(os.path.join(here, "cuda", "*.h")))
        + plan["cu"],
        include_dirs=[np.get_include(), "csrc", "csrc/bindings", "cuda"] + plan["inc"],
        library_dirs=plan["lib"],
        extra_compile_args=cflags,
        extra_link_args=ldflags + ["-lcudart_static", plan["cublas"], "-ldl", "-lrt", "-lstdc++"],
    )
    cuda_ext.cu_sources = plan["cu"]
    cuda_ext.cuda_plan = plan
    ext_modules.append(cuda_ext)

# link order: smoe_pybind uses smoe_core, so it comes first
setup(ext_modules=ext_modules, libraries=[pybind_lib, core_lib],
      cmdclass={"build_ext": BuildExt, "build_clib": BuildClib})
