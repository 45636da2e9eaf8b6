"""benchmarks/hostinfo.py names the AMD core generation a results file was measured on (virtual
machines often call every CPU "AMD EPYC"): cpuid family and model of known parts."""
import ast
import os
import subprocess
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


def test_peer_env_gives_peers_libgomps_default_wait_policy(monkeypatch):
    """hostinfo (imported before torch) sets the wait policy ``import specmoe`` sets; a peer
    program (llama.cpp runs on libgomp too) gets the environment without it, other variables
    kept, extras added, and host() records both sides' policy."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("SPECMOE_TEST_KEEP", "1")
    env = hostinfo.peer_env(OMP_NUM_THREADS="3")
    assert "OMP_WAIT_POLICY" not in env
    assert env["SPECMOE_TEST_KEEP"] == "1" and env["OMP_NUM_THREADS"] == "3"
    assert hostinfo.peer_env({"OMP_WAIT_POLICY": "ACTIVE", "A": "b"}) == {"A": "b"}
    assert hostinfo.host()["omp_wait_policy"] == {"specmoe": "PASSIVE", "peers": None}


def _fake_bench(tmp_path):
    """A stand-in for llama-bench that reports 1 tok/s when it runs without OMP_WAIT_POLICY
    and 2 when it inherited one."""
    b = tmp_path / "llama-bench"
    b.write_text('#!/bin/sh\nif [ -z "${OMP_WAIT_POLICY+x}" ]; then v=1; else v=2; fi\n'
                 'echo "[{\\"avg_ts\\": $v}]"\n')
    b.chmod(0o755)
    return b


def test_the_harnesses_run_llama_cpp_without_specmoes_wait_policy(tmp_path, monkeypatch):
    """Every place a benchmark starts llama.cpp hands it peer_env: with PASSIVE inherited its
    OpenMP workers sleep between two tokens' graphs (0.6x its decode speed measured)."""
    import big_model
    import hybrid_peers
    import hybrid_prefill
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    bench = _fake_bench(tmp_path)
    assert hybrid_prefill.llama_prefill(bench, tmp_path / "m.gguf", 32, 1) == {"tok_per_s": 1.0}
    assert hybrid_peers.llama_row(bench, tmp_path / "m.gguf", 1) == {"tok_per_s": 1.0}
    r = big_model.run_process(["sh", "-c", "echo ${OMP_WAIT_POLICY:-unset}"], None, 60)
    assert r["stdout"].strip() == "unset"  # (LlamaCpp's llama-completion runs go through it)
    r = big_model.run_process(["sh", "-c", "echo ${OMP_WAIT_POLICY:-unset}"], None, 60,
                              env=dict(os.environ))
    assert r["stdout"].strip() == "PASSIVE"  # an explicit env (a specmoe worker's) is kept



def test_llama_cpp_converter_gets_its_missing_modules_or_a_named_reason(tmp_path, monkeypatch):
    """convert_hf_to_gguf.py imports sentencepiece on the Llama / Mixtral vocabulary path (the
    zoo model's); LlamaCpp installs what is missing, and a failed install is every type's
    reason, with the converter not run."""
    import big_model
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(big_model.subprocess, "run", fake_run)
    lc = big_model.LlamaCpp.__new__(big_model.LlamaCpp)
    lc.src, lc.bin = tmp_path / "src", tmp_path / "bin"
    monkeypatch.setattr(big_model.LlamaCpp, "CONVERTER_MODULES", {"json": "json"})
    assert lc._converter_deps() is None and calls == []  # present: pip not run
    monkeypatch.setattr(big_model.LlamaCpp, "CONVERTER_MODULES",
                        {"no_such_module_for_specmoe": "no-such-package"})
    res = lc.convert(tmp_path / "ckpt", tmp_path / "out", ["Q4_0", "Q8_0"], "h", False)
    assert [a[:4] + a[-1:] for a in calls] == [
        [sys.executable, "-m", "pip", "install", "no-such-package"]]
    assert set(res) == {"Q4_0", "Q8_0"}
    assert all("needs no-such-package" in r and "No matching distribution" in r
               for r in res.values())
    assert not list((tmp_path / "out").glob("*.gguf"))

def _imports(path):
    """(line, top-level module, at module level) of each absolute import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name.split(".")[0], id(n) in top) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.append((n.lineno, n.module.split(".")[0], id(n) in top))
    return sorted(out)


def test_every_benchmark_sets_the_wait_policy_before_it_imports_torch():
    """A benchmark that imports torch imports hostinfo or specmoe (or a benchmark module that
    does) at module level before its first torch import, so specmoe is timed as a user who
    imports it first runs it: 17 did not, and timed specmoe with torch's workers spinning."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    mods = {p.stem: _imports(p) for p in bench.glob("*.py")}

    def first_torch(name):
        return min((ln for ln, m, _ in mods[name] if m == "torch"), default=None)

    def sets_policy(name, seen=()):
        if name in ("hostinfo", "specmoe"):
            return True
        if name not in mods or name in seen:
            return False
        first = min((ln for ln, m, top in mods[name]
                     if top and sets_policy(m, seen + (name,))), default=None)
        t = first_torch(name)
        return first is not None and (t is None or first < t)

    late = sorted(n for n in mods if first_torch(n) is not None and not sets_policy(n))
    assert late == []
    assert sets_policy("hybrid_prefill") and not sets_policy("no_such_module")


def test_llama_wait_policy_times_each_round_under_both_policies(tmp_path):
    """benchmarks/llama_wait_policy.py runs llama-bench under libgomp's default and under
    PASSIVE in every round (the fake bench reports 1 and 2 tok/s), whatever its own
    environment holds."""
    import json
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "llama_wait_policy.py"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    r = subprocess.run([sys.executable, str(script), str(gguf), "--bench",
                        str(_fake_bench(tmp_path)), "--threads", "1,2", "--rounds", "2",
                        "--json"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [(x["threads"], x["default"], x["passive"], x["passive_over_default"])
            for x in out["rows"]] == [(1, [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]),
                                      (2, [1.0, 1.0], [2.0, 2.0], [2.0, 2.0])]
    assert out["host"]["cpu_isa"] in ("avx512", "avx2", "scalar")
