#!/usr/bin/env bash
# The GPU tier's checks for one session on a lent GPU machine (docs/gpu.md), in one run:
# build specmoe._C and specmoe._cuda with -Werror, measure the simulator's profile of the GPU
# tier (specmoe.sim.calibration.calibrate_gpu), run tests/test_cuda.py and tests/test_gpu_tier.py (the engine on the device), then benchmarks/gpu_generate.py
# and benchmarks/gpu_hybrid.py (the hybrid tier, issue 37).
#
#   benchmarks/gpu_check.sh OUTDIR
#
# SKIP=calibrate,generate,hybrid leaves steps out (a session that measured them already);
# HYBRID_ARGS passes options to gpu_hybrid.py (default: --layers 6 --dtypes bf16,int4); GEN_S
# the seconds kept for gpu_generate after it (default 200); TEST_K selects tests (pytest -k).
#
# Needs a python3 with a CUDA build of torch (PY=... to choose another).  What
# benchmarks/gpu_carry.sh put in .whl/ (git-ignored; carry it) is unpacked first:
# site.tar.xz (the transformers/tokenizers/regex versions this checkout's tests use, and
# gguf) into /tmp/site (or wheels in .whl/ installed there), llama-cuda.tar.xz (llama-bench
# built with CUDA, for gpu_hybrid's llama.cpp rows) into /tmp/llama.  Every step writes its
# log or JSON into OUTDIR and a summary to stdout; BUDGET_S (default 560) bounds the whole
# run: the benchmarks get what is left after the tests.
set -u -o pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
# transformers >= 5.25 fetches hub kernels (liger's RMSNorm) in from_pretrained on CUDA by
# default; the lent machine has no network, so the unmodified rows would fail to load
export USE_HUB_KERNELS=0
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
if [ -f .whl/site.tar.xz ]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 1
    export PYTHONPATH=/tmp/site:$PWD
elif ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
if [ -f .whl/llama-cuda.tar.xz ]; then
    mkdir -p /tmp/llama && tar -C /tmp/llama -xJf .whl/llama-cuda.tar.xz \
        && export SPECMOE_LLAMA_BENCH=/tmp/llama/llama-bench
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/smi.txt"
SPECMOE_CUDA=1 SPECMOE_WERROR=1 SPECMOE_CUDA_ARCH=${SPECMOE_CUDA_ARCH:-90} \
    $PY setup.py --quiet build_ext --inplace > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
echo "== built in $(elapsed) s"

# summary FILE KEY...: a benchmark's JSON, each row's label with those keys, then its other
# top-level fields
summary() {
    $PY - "$@" <<'PYEOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no JSON: {e}")
for r in d.get("rows", []):
    print(r["label"], {k: r.get(k) for k in sys.argv[2:] if k in r})
print({k: v for k, v in d.items() if k not in ("rows", "host")})
PYEOF
}
skip() { case ",${SKIP:-}," in *",$1,"*) return 0 ;; esac; return 1; }
if ! skip calibrate; then
    timeout 90 $PY -c 'import json; from specmoe.sim.calibration import calibrate_gpu
print(json.dumps(calibrate_gpu().to_dict()))' > "$out/gpu_profile.json" 2> "$out/gpu_profile.err"
    echo "== calibrate rc=$? at $(elapsed) s"
    cat "$out/gpu_profile.json"; tail -5 "$out/gpu_profile.err"
fi

timeout 240 $PY -m pytest -q -rs --durations=15 ${TEST_K:+-k "$TEST_K"} tests/test_cuda.py \
    tests/test_gpu_tier.py > "$out/test_cuda.log" 2>&1
echo "== test_cuda rc=$? at $(elapsed) s"
grep -E "passed|failed|error|SKIPPED|FAILED" "$out/test_cuda.log" | tail -25

# the hybrid benchmark leaves GEN_S (default 200) for gpu_generate when that runs; stopped
# by its timeout it keeps what it measured (its results file is rewritten after each stage)
left=$(( ${BUDGET_S:-560} - $(elapsed) ))
skip generate || left=$(( left - ${GEN_S:-200} ))
if ! skip hybrid && [ "$left" -gt 60 ]; then
    timeout "$left" $PY benchmarks/gpu_hybrid.py --json --workdir /tmp/specmoe-bench \
        --out "$out/gpu_hybrid.json" ${HYBRID_ARGS:---layers 6 --dtypes bf16,int4} \
        > /dev/null 2> "$out/gpu_hybrid.err"
    echo "== gpu_hybrid rc=$? at $(elapsed) s"
    summary "$out/gpu_hybrid.json" tok_s prefill_tok_s vs_copy_every_miss tokens_equal \
        hit_rate cpu_share_of_experts pcie_bytes_per_token vram_bytes \
        specmoe_hybrid_over_this error
    tail -5 "$out/gpu_hybrid.err"
fi
left=$(( ${BUDGET_S:-560} - $(elapsed) ))
if ! skip generate && [ "$left" -gt 60 ]; then
    timeout "$left" $PY benchmarks/gpu_generate.py --json --workdir /tmp/specmoe-bench \
        > "$out/gpu_generate.json" 2> "$out/gpu_generate.err"
    echo "== gpu_generate rc=$? at $(elapsed) s"
    summary "$out/gpu_generate.json" tok_s tokens_equal hit_rate error
    tail -5 "$out/gpu_generate.err"
else
    echo "== gpu_generate skipped: $left s left"
fi
