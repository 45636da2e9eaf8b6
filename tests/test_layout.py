"""The package's layering: the engine side (store, cache, kernels, the Engine and what it owns)
never imports the speculative-decoding side (controllers, drafters, generate, MTP), so either
can change without the other, and the old module names still resolve."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "specmoe"

ENGINE_SIDE = ("arch", "cache", "conversion", "cuda", "dense", "expert_copy", "hardware", "hf",
               "kernels", "lookahead", "misses", "mla", "policies", "pretrained", "quant",
               "recording", "sim", "store", "sweep", "traces", "experts", "engine_base",
               "layers", "calibration")
SPEC_SIDE = ("controllers", "drafters", "generation", "generation_batch", "mtp", "verify",
             "sampling", "decoding", "tau")
# (module, enclosing function): the one documented way back -- Engine.generate is a
# convenience that calls specmoe.generate
ALLOWED = {("engine_base", "generate")}


def _imports(mod: str):
    """(imported specmoe submodule, enclosing function or None) for every import in ``mod``."""
    tree = ast.parse((PKG / f"{mod}.py").read_text())
    out = []

    def visit(node, fn):
        for ch in ast.iter_child_nodes(node):
            f = ch.name if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(ch, ast.ImportFrom) and ch.level >= 1:
                if ch.module:
                    out.append((ch.module.split(".")[0], f))
                else:
                    out.extend((a.name, f) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom) and (ch.module or "").startswith("specmoe."):
                out.append((ch.module.split(".")[1], f))
            elif isinstance(ch, ast.Import):
                out.extend((a.name.split(".")[1], f) for a in ch.names
                           if a.name.startswith("specmoe."))
            visit(ch, f)

    visit(tree, None)
    return out


@pytest.mark.parametrize("mod", ENGINE_SIDE)
def test_engine_side_never_imports_the_speculative_side(mod):
    bad = [(m, fn) for m, fn in _imports(mod) if m in SPEC_SIDE and (mod, fn) not in ALLOWED]
    assert not bad, f"specmoe/{mod}.py imports {bad}"


def test_the_scan_sees_imports():
    """The scanner itself: it finds hf's allowed import and drafters' imports."""
    assert ("generation", "generate") in _imports("hf")
    assert ("expert_copy", None) in _imports("drafters")
    assert ("mtp", None) in _imports("drafters")
