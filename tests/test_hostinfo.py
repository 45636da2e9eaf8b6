"""benchmarks/hostinfo.py names the AMD core generation a results file was measured on (virtual
machines often call every CPU "AMD EPYC"): cpuid family and model of known parts."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import hostinfo  # noqa: E402


@pytest.mark.parametrize("family,model,core", [
    (0x17, 0x01, "Zen / Zen+"),   # EPYC 7001 Naples
    (0x17, 0x08, "Zen / Zen+"),   # Ryzen 2000 Pinnacle Ridge
    (0x17, 0x31, "Zen 2"),        # EPYC 7002 Rome
    (0x17, 0x71, "Zen 2"),        # Ryzen 3000 Matisse
    (0x19, 0x01, "Zen 3"),        # EPYC 7003 Milan
    (0x19, 0x11, "Zen 4"),        # EPYC 9004 Genoa
    (0x1A, 0x02, "Zen 5"),        # EPYC 9005 Turin
    (0x15, 0x02, None),           # Bulldozer family: not named
])
def test_amd_core_generation_by_cpuid_family_and_model(family, model, core):
    assert hostinfo.amd_core(family, model) == core
