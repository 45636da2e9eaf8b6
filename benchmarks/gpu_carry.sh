#!/usr/bin/env bash
# What a device session carries to the lent GPU machine (docs/gpu.md), made here before it
# starts: the lent machine has no network, and its image's Python packages are not the
# versions this checkout's tests use.
#
#   benchmarks/gpu_carry.sh            # both parts into .whl/ (git-ignored; add /.whl/ to
#                                      # .git/info/exclude once)
#   SKIP_LLAMA=1 benchmarks/gpu_carry.sh
#
# 1. .whl/site.tar.xz: transformers with what it imports (this checkout's versions, read
#    from .venv; numpy is the device's) and gguf, as installed for CPython 3.12 (the device's
#    python3), transformers' model folders cut to those this checkout uses, xz-compressed
#    (15 MB: the working tree and what is carried share 64 MiB).
# 2. .whl/llama-cuda.tar.xz: llama.cpp's llama-bench built with CUDA for sm_90 (H100/H200)
#    from the llama-cpp-python source distribution that benchmarks/big_model.py builds its
#    CPU peer from, linked statically but for the CUDA driver and cuBLAS (the device's
#    torch wheels hold libcublas; benchmarks/gpu_hybrid.py puts them on LD_LIBRARY_PATH).
#    FlashAttention kernels are left out (GGML_CUDA_FA=OFF: a third of the build on two
#    cores; llama-bench runs with -fa off), the GPU code is sm_90 machine code only (no PTX:
#    the PTX doubled the 22 MB of compressed kernels and the tarball must fit beside the
#    tree), the CPU backend is built for AVX-512 with VNNI (the device's Xeon), not for
#    this host.  Needs nvcc (CUDA 13 here) and cuBLAS: where
#    the toolkit has no libcuda.so stub (the pip wheels do not ship one), a stub exporting
#    cuda.h's functions is made to link against; the real driver is loaded on the device.
#    About an hour on two cores.
set -eu -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PEERS=${PEERS:-$HOME/.cache/specmoe/peers}
mkdir -p .whl
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }

dl=$(mktemp -d)
site=$(mktemp -d)
trap 'rm -rf "$dl" "$site"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
# transformers and everything it needs at import, at .venv's versions (transformers checks
# huggingface-hub's version on import, and the device image's is older), but numpy, which
# the device's torch was built against; gguf for the llama.cpp rows
reqs=$($PY - <<'PYEOF'
import importlib.metadata as m, re
seen, todo = set(), ["transformers", "gguf"]
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop().lower())
    if name in seen or name == "numpy":
        continue
    try:
        deps = m.requires(name) or []
    except m.PackageNotFoundError:     # an optional dependency .venv does not have
        continue
    seen.add(name)
    todo += [re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in deps if "extra ==" not in d]
print(" ".join(f"{n}=={m.version(n)}" for n in sorted(seen)))
PYEOF
)
for r in $reqs; do
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$dl" "$r"
done
python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$site" "$dl"/*.whl
# transformers' model folders: only those this checkout names (its architecture tables, the
# tiny test models, the GPU tests) and what they import (2.6 MB less to carry)
python3 - "$site/transformers/models" specmoe/models/arch.py specmoe/models/testing.py \
    tests/test_cuda.py tests/test_gpu_tier.py <<'PYEOF'
import re, shutil, sys
from pathlib import Path
root, srcs = Path(sys.argv[1]), sys.argv[2:]
text = "".join(Path(p).read_text() for p in srcs)
models = {d.name for d in root.iterdir() if d.is_dir()}
keep = {m for m in models if re.search(r"[\"']" + re.escape(m) + r"[\"']", text)} | {"auto"}
todo = list(keep)
while todo:
    for f in (root / todo.pop()).glob("*.py"):
        for m in re.findall(r"from \.\.(\w+)", f.read_text()):
            if m in models and m not in keep:
                keep.add(m)
                todo.append(m)
for m in models - keep:
    shutil.rmtree(root / m)
print(f"transformers: {len(keep)} of {len(models)} model folders kept")
PYEOF
tar -C "$site" -cJf .whl/site.tar.xz .
echo "site.tar.xz: $(du -h .whl/site.tar.xz | cut -f1)"

[ -n "${SKIP_LLAMA:-}" ] && exit 0
src=$(ls -d "$PEERS"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | tail -1)
[ -n "$src" ] || { echo "no llama-cpp-python source in $PEERS: run benchmarks/big_model.py's peer build first" >&2; exit 1; }
NVCC=$(command -v nvcc) || { echo "no nvcc on PATH" >&2; exit 1; }
# the toolkit's root as nvcc itself reports it (nvcc on PATH may be a wrapper script)
top=$("$NVCC" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
CUDA_ROOT=${CUDA_ROOT:-$(readlink -f "$top")}
# cuBLAS from the nvidia-cublas wheel in .venv where the toolkit has none (CMake's
# FindCUDAToolkit looks for it beside cudart)
if [ ! -e "$CUDA_ROOT/include/cublas_v2.h" ]; then
    wheel=$($PY -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")/nvidia/cu13
    for f in "$wheel"/include/cublas*.h; do ln -sf "$f" "$CUDA_ROOT/include/"; done
    for f in "$wheel"/lib/libcublas*.so.*; do
        ln -sf "$f" "$CUDA_ROOT/lib/"; ln -sf "$f" "$CUDA_ROOT/lib/$(basename "${f%.so.*}").so"
    done
fi
if ! ls "$CUDA_ROOT"/lib*/libcuda.so "$CUDA_ROOT"/lib*/stubs/libcuda.so >/dev/null 2>&1; then
    mkdir -p "$CUDA_ROOT/lib/stubs"
    echo '#include <cuda.h>' | gcc -E -I"$CUDA_ROOT/include" - | python3 -c '
import re, sys
names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", sys.stdin.read())))
print("".join(f"int {n}(void){{return 999;}}\n" for n in names))' > "$dl/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_ROOT/lib/stubs/libcuda.so" "$dl/stub.c"
fi
build="$PEERS/llama.cpp-cuda"
mkdir -p "$build"
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DCUDAToolkit_ROOT="$CUDA_ROOT" -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > "$build/cmake.log"
cmake --build "$build" --target llama-bench -j"$(nproc)" > "$build/build.log"
# libgomp (the CPU backend's OpenMP) beside it: the device's image may have none
pack=$(mktemp -d)
cp "$build/bin/llama-bench" "$pack/" && strip "$pack/llama-bench"
cp "$(gcc -print-file-name=libgomp.so.1)" "$pack/"
tar -C "$pack" -cJf .whl/llama-cuda.tar.xz llama-bench libgomp.so.1
rm -rf "$pack"
echo "llama-cuda.tar.xz: $(du -h .whl/llama-cuda.tar.xz | cut -f1)"
