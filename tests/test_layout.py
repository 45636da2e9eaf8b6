"""The package's layout, read from its sources (issue 36, item 5).

* The import graph has no cycle.  Every import counts, those inside functions too (they are how
  cycles used to be held apart); ``if TYPE_CHECKING:`` blocks do not (they never run).  Importing
  ``specmoe.a.b`` runs ``specmoe/a/__init__.py`` first, so each module also depends on its
  subpackage's ``__init__``; the root ``specmoe/__init__.py`` is the public facade that imports
  from everything and is left out (nothing inside the package may import from it, see below).
* No module imports a private name (``_x``) of another module, nor a name from the root facade.
* The engine side (storage, runtime, models) never imports the speculation side, except the one
  documented convenience ``EngineCommon.generate``.
* The pre-0.2 module names raise with their new name; the public names of ``specmoe`` work.
"""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specmoe"
EXTENSIONS = {"specmoe._C", "specmoe._cuda"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _strip_type_checking(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            if getattr(t, "id", None) == "TYPE_CHECKING" or getattr(t, "attr", None) == \
                    "TYPE_CHECKING":
                node.body = []


def _imports(mod: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each import in ``mod``."""
    tree = ast.parse(MODULES[mod].read_text())
    _strip_type_checking(tree)
    pkg = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names
                    if a.name.split(".")[0] == "specmoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)] + (node.module.split(".")
                                                              if node.module else [])
            elif (node.module or "").split(".")[0] == "specmoe":
                base = node.module.split(".")
            else:
                continue
            b = ".".join(base)
            for a in node.names:
                sub = f"{b}.{a.name}"
                if sub in MODULES or sub in EXTENSIONS:
                    out.append((sub, None, node.lineno))
                else:
                    out.append((b, a.name, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target in MODULES and target != m and target != "specmoe":
                g[m].add(target)
        parts = m.split(".")
        for i in range(2, len(parts)):            # enclosing subpackages (not the root)
            parent = ".".join(parts[:i])
            if parent != m:
                g[m].add(parent)
    for m in MODULES:  # a package's __init__ that imports its own child is the facade pattern:
        for child in [c for c in g[m] if _is_package(m) and c.startswith(m + ".")]:
            g[child].discard(m)  # the child runs inside that import, the edge back is no cycle
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    g = _graph()
    cycles = _cycles(g)
    detail = "\n".join(f"  {c}: " + "; ".join(f"{m} -> {sorted(g[m] & set(c))}" for m in c)
                       for c in cycles)
    assert not cycles, f"import cycles:\n{detail}"


def test_the_cycle_check_sees_cycles():
    """The checker itself: a two-module cycle, a cycle through a function-level import and a
    subpackage's __init__ edge are found; a chain is not a cycle."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    g = _graph()
    # the scan sees function-level imports: EngineCommon.generate imports the generate loop
    assert "specmoe.speculation.generation" in g["specmoe.runtime.engine_base"]
    assert "specmoe.sim" in g["specmoe.sim.traces"]          # its subpackage's __init__
    # ... unless that __init__ imports the module itself (controllers/__init__ re-exports)
    assert "specmoe.speculation.controllers.cascade" in g["specmoe.speculation.controllers"]
    assert "specmoe.speculation.controllers" not in g["specmoe.speculation.controllers.cascade"]


def test_no_private_names_across_modules():
    bad = []
    for m in MODULES:
        for target, name, line in _imports(m):
            if name is not None and target == "specmoe" and m != "specmoe":
                bad.append(f"{m}:{line} imports {name} from the root facade")
            elif target in EXTENSIONS or target == m:
                continue
            elif name is not None and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{m}:{line} imports {target}.{name}")
            elif name is None and target.rsplit(".", 1)[-1].startswith("_") \
                    and target not in EXTENSIONS and target.rsplit(".", 1)[0] != m \
                    and m != "specmoe":
                bad.append(f"{m}:{line} imports the private module {target}")
    assert not bad, "\n".join(bad)


ENGINE_SIDE = ("specmoe.storage", "specmoe.runtime", "specmoe.models")
# (module, function): the documented way up -- Engine.generate calls specmoe.generate
ALLOWED_UP = {("specmoe.runtime.engine_base", "generate")}


def _function_of(mod: str) -> dict[int, str]:
    """line -> name of the innermost function enclosing it, for ``mod``."""
    tree = ast.parse(MODULES[mod].read_text())
    fns = sorted((n for n in ast.walk(tree)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                 key=lambda n: n.lineno)
    out: dict[int, str] = {}
    for n in fns:                       # an inner function starts later: it overwrites
        for ln in range(n.lineno, (n.end_lineno or n.lineno) + 1):
            out[ln] = n.name
    return out


@pytest.mark.parametrize("mod", [m for m in MODULES if m.startswith(ENGINE_SIDE)])
def test_engine_side_never_imports_the_speculation_side(mod):
    fn = _function_of(mod)
    bad = [(t, line) for t, _, line in _imports(mod)
           if t.startswith("specmoe.speculation") and (mod, fn.get(line)) not in ALLOWED_UP]
    assert not bad, f"{mod} imports {bad}"


@pytest.mark.parametrize("old,new", [("hf", "specmoe.runtime.engine"),
                                     ("store", "specmoe.storage.store"),
                                     ("generation_batch", "specmoe.speculation.batch"),
                                     ("spec", "specmoe.speculation"),
                                     ("kernels", "specmoe.runtime.kernels")])
def test_old_module_names_raise_with_the_new_name(old, new):
    import specmoe
    with pytest.raises(specmoe.MovedModuleError, match=f"specmoe.{old} moved to {new}"):
        importlib.import_module(f"specmoe.{old}")
    assert isinstance(specmoe.MovedModuleError("x"), ModuleNotFoundError)
    if old != "kernels":        # specmoe.kernels stays a public attribute
        with pytest.raises(specmoe.MovedModuleError, match=f"moved to {new}"):
            exec(f"from specmoe import {old}", {})
        with pytest.raises(specmoe.MovedModuleError, match=f"moved to {new}"):
            getattr(specmoe, old)
    assert f"specmoe.{old}" not in sys.modules


def test_public_names_keep_working():
    import specmoe
    from specmoe.runtime import engine, kernels
    from specmoe.speculation import generation
    from specmoe.storage import quant
    assert specmoe.kernels is kernels and specmoe.quant is quant
    assert specmoe.generate is generation.generate and specmoe.offload is engine.offload
    for name in specmoe.__all__:
        assert getattr(specmoe, name) is not None, name
    with pytest.raises(AttributeError):
        specmoe.no_such_name


CSRC = ROOT.parent / "csrc"


def test_c_bindings_live_in_one_folder():
    """Every C file that includes Python.h is under csrc/bindings/ (the core, csrc/ and cuda/,
    stays plain C: setup.py compiles it once into smoe_core for both extensions)."""
    bad = [str(p.relative_to(ROOT.parent)) for p in sorted(CSRC.rglob("*.[ch]"))
           + sorted((ROOT.parent / "cuda").glob("*.[ch]"))
           if "bindings" not in p.parts and "#include <Python.h>" in p.read_text()]
    assert not bad, f"Python.h outside csrc/bindings: {bad}"


def test_one_expert_descriptor_parser():
    """The FFN descriptor dict is read in one place (csrc/bindings/py_desc.c, linked into both
    extensions through smoe_pybind); py_cuda.c used to carry its own copy with other limits."""
    readers = [p.name for p in sorted(CSRC.rglob("*.c")) if '"gate_scale"' in p.read_text()]
    assert readers == ["py_desc.c"]


def test_no_module_reaches_into_an_engines_private_state():
    """Outside the engines' own modules, an engine is used through its public surface
    (``layers``, ``cache``, ``layer_call_slot``, ``routable``, ``layer_forward``,
    ``draft_copy``, ``lowbit_copy``, ``recorder``...): the modules that used to read
    ``eng._layers`` and friends named state whose owner could then not change it alone."""
    import re
    own = {"specmoe.runtime.engine", "specmoe.runtime.gpu_engine", "specmoe.runtime.engine_base"}
    pat = re.compile(r"\b(eng|engine|_engine|self\.engine|self\._engine)\._[a-z]\w*")
    bad = [f"{m}:{i}: {hit.group(0)}" for m, p in MODULES.items() if m not in own
           for i, line in enumerate(p.read_text().splitlines(), 1) for hit in pat.finditer(line)]
    assert not bad, "\n".join(bad)


def test_bindings_stay_thin():
    """No binding file above about 1,000 lines: the decoder blocks, the MoE layer and the caches
    are plain C in csrc/ (csrc/decoder.h and its files), the bindings parse and convert."""
    big = {p.name: n for p in sorted((CSRC / "bindings").glob("*.c"))
           if (n := len(p.read_text().splitlines())) > 1000}
    assert not big, big


# Folders whose scripts import each other by bare name: running one, or a test that imports
# one, puts the folder first on sys.path.
SCRIPT_FOLDERS = ("benchmarks", "training", "tests/fuzz")


def _names_others_import() -> set[str]:
    """Top-level module names that code we run may import: the standard library's, every
    installed distribution's, and the optional packages transformers probes for by name (its
    ``_is_package_available("...")`` calls: it imports one when the name resolves, installed or
    not)."""
    import importlib.metadata
    import inspect
    import re

    from transformers.utils import import_utils
    names = set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())
    probed = re.findall(r'_is_package_available\(\s*"([\w.]+)"', inspect.getsource(import_utils))
    assert "kernels" in probed, "the probe list was not found in transformers' source"
    return names | {p.split(".")[0] for p in probed}


def test_no_script_shadows_a_package():
    """A script named like a package is imported in its place once its folder is on sys.path:
    benchmarks/kernels.py stood for the Hub ``kernels`` package that transformers 5.25 imports
    when the name resolves, and 30 tests failed on a fresh install (now expert_kernels.py)."""
    taken = _names_others_import()
    bad = [f"{folder}/{p.name}" for folder in SCRIPT_FOLDERS
           for p in sorted((ROOT.parent / folder).glob("*.py")) if p.stem in taken]
    assert not bad, f"scripts named like packages others import: {bad}"


def _planted_table() -> dict[str, set[str]]:
    """docs/architecture.md's table of ``_specmoe_*`` attributes: name -> the module stems
    (``attention``, ``engine``, ...) it lists as writing or reading it."""
    import re
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    part = doc.split("### What specmoe keeps on transformers' objects", 1)[1]
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^\| `(_specmoe_\w+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \|", part, re.M):
        out[m.group(1)] = {s.strip() for s in (m.group(2) + "," + m.group(3)).split(",")}
    return out


def test_every_attribute_planted_on_transformers_modules_is_listed():
    """Issue 36: the ``_specmoe_*`` attributes specmoe keeps on transformers' modules are one
    documented table (docs/architecture.md), each with the files that write and read it, so a
    new one, or a new reader of one, is a visible decision rather than a quiet coupling."""
    import re
    used: dict[str, set[str]] = {}
    for p in MODULES.values():
        for name in set(re.findall(r"\b_specmoe_[a-z0-9_]+\b", p.read_text())):
            used.setdefault(name, set()).add(p.stem)
    table = _planted_table()
    assert len(table) >= 10, "the table was not found in docs/architecture.md"
    assert sorted(set(used) - set(table)) == [], "used in specmoe/ but not in the table"
    assert sorted(set(table) - set(used)) == [], "in the table but no longer used"
    wrong = {n: (sorted(used[n]), sorted(table[n])) for n in used if used[n] != table[n]}
    assert wrong == {}, "files that use each name (left) against the table's (right)"
    # one owner each: a module that needs another's state calls the owner's functions
    # (models.layers' chain_step, decode_route, dense_mlp, adapter_active, ...)
    shared = {n: sorted(f) for n, f in used.items() if len(f) > 1}
    assert shared == {}, "planted attributes written or read by more than one file"
