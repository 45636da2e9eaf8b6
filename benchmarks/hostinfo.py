"""What every results file records about the machine: CPU model, the ISA the CPU has, the ISA
specmoe's kernels run (``SPECMOE_ISA`` may force a lower one), core count.  A speed figure is a
claim about one host: the JSON says which."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu() -> dict[str, Any]:
    """CPU model, its best vector ISA (scalar / avx2 / avx512) and the AVX-512 extensions the
    kernels use, from /proc/cpuinfo (no import of specmoe: ab_commits.py runs before a build)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "scalar"
    return {"cpu": model, "cpu_isa": isa, "avx512_vnni": "avx512_vnni" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "cores": os.cpu_count(),
            "python": platform.python_version()}


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
    if threads is not None:
        d["threads"] = threads
    return d
