"""What every results file records about the machine: CPU model, the ISA the CPU has, the ISA
specmoe's kernels run (``SPECMOE_ISA`` may force a lower one), core count.  A speed figure is a
claim about one host: the JSON says which."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Mapping

# What ``import specmoe`` sets when it comes before torch (specmoe/__init__.py): torch's OpenMP
# workers sleep between parallel regions instead of spinning on the cores the kernels' pool
# runs on next.  libgomp reads it when torch is imported, so a benchmark imports this module
# before torch and times specmoe as a user who imports it first gets it, whatever the order of
# its own imports (a 32-token prompt of benchmarks/hybrid_prefill.py's Qwen3.5-MoE file, 2
# threads, AMD EPYC Zen 4, one-off: 115 ms a forward passive, 148-170 ms spinning).  Peers
# get libgomp's default back (peer_env).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# AMD's core generations by cpuid family, and within families 0x17 and 0x19 by model (Zen and
# Zen+: Naples, Summit / Pinnacle Ridge, Raven Ridge, Picasso, models below 0x30; Zen 2: Rome,
# Matisse, Renoir and later; Zen 3: Milan, Vermeer, Rembrandt, Cezanne; Zen 4: Genoa, Raphael,
# Phoenix, Bergamo / Siena).  Virtual machines often name the CPU "AMD EPYC" alone, so these
# say which EPYC a figure came from.
_AMD_FAMILIES = {0x1A: "Zen 5"}
_ZEN3 = (range(0x00, 0x10), range(0x20, 0x30), range(0x40, 0x60))
_ZEN4 = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def amd_core(family: int, model: int) -> str | None:
    """AMD's core generation for a cpuid ``family`` and ``model`` (None: not one named here)."""
    if family == 0x17:
        return "Zen / Zen+" if model < 0x30 else "Zen 2"
    if family == 0x19:
        return ("Zen 3" if any(model in r for r in _ZEN3)
                else "Zen 4" if any(model in r for r in _ZEN4) else None)
    return _AMD_FAMILIES.get(family)


def cpu() -> dict[str, Any]:
    """CPU model, its cpuid family / model (and, for AMD, the core generation they mean), its
    best vector ISA (scalar / avx2 / avx512) and the AVX-512 extensions the kernels use, from
    /proc/cpuinfo (no import of specmoe: ab_commits.py runs before a build)."""
    model, flags = platform.processor(), set()
    vendor, family, number = "", None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key == "model name" and model in ("", "x86_64"):
                model = val
            elif key == "vendor_id" and not vendor:
                vendor = val
            elif key == "cpu family" and family is None:
                family = int(val)
            elif key == "model" and number is None:
                number = int(val)
            elif key == "flags":
                flags = set(val.split())
                break
    except (OSError, ValueError):
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "scalar"
    d: dict[str, Any] = {"cpu": model, "cpu_family": family, "cpu_model": number}
    if vendor == "AuthenticAMD" and family is not None and number is not None:
        d["cpu_core"] = amd_core(family, number)
    d.update({"cpu_isa": isa, "avx512_vnni": "avx512_vnni" in flags,
              "avx512_bf16": "avx512_bf16" in flags, "cores": os.cpu_count(),
              "python": platform.python_version()})
    return d


def peer_env(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment a peer program (llama.cpp's tools) runs in: ``env`` (default ours) with
    ``extra`` and without ``OMP_WAIT_POLICY``, which this module and ``import specmoe`` set
    for torch.  llama.cpp runs on libgomp too, and there the passive policy puts its workers
    to sleep between two tokens' graphs: at 2 threads its decode ran 0.43-0.80x as fast
    passive, at 1 thread as fast (benchmarks/llama_wait_policy.py, AMD EPYC Zen 4,
    results/llama_wait_policy_epyc_zen4.json).  Results files whose host() records
    ``omp_wait_policy`` ran their peers in this environment."""
    e = dict(os.environ if env is None else env)
    e.pop("OMP_WAIT_POLICY", None)
    e.update(extra)
    return e


def host(threads: int | list[int] | None = None) -> dict[str, Any]:
    """cpu() plus the ISA specmoe's kernels run here (``specmoe_isa``) and, when given, the
    thread count(s) of the run."""
    d = cpu()
    try:
        from specmoe.runtime import kernels
        d["specmoe_isa"] = kernels.isa()
    except Exception as e:  # noqa: BLE001 -- recorded, not fatal: the figure still has a host
        d["specmoe_isa"] = f"unknown ({type(e).__name__})"
    d["SPECMOE_ISA"] = os.environ.get("SPECMOE_ISA")
    # the OpenMP wait policy specmoe's side ran under, and the peers' (peer_env: the default)
    d["omp_wait_policy"] = {"specmoe": os.environ.get("OMP_WAIT_POLICY"), "peers": None}
    if threads is not None:
        d["threads"] = threads
    return d


def emit(res: dict[str, Any], save: str | None, as_json: bool) -> None:
    """A benchmark's result: written to ``save`` when given, printed as one JSON object
    (``as_json``) or as its rows one per line."""
    import json
    from pathlib import Path

    text = json.dumps(res, indent=1)
    if save:
        Path(save).write_text(text + "\n")
    if as_json:
        print(text)
    else:
        for r in res.get("rows", []):
            print(r)
