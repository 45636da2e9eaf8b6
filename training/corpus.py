"""Build the specmoe zoo corpus: Python source code and English prose, each split into a
training part and a held-out part.

Sources (both under the Python Software Foundation licence):

* code:  the pure-Python standard library of the interpreter running this script
         (``sysconfig.get_paths()["stdlib"]``), without its test suites and without
         site-packages.  Licence: the ``LICENSE.txt`` shipped in that directory.
* prose: the English reStructuredText sources of the Python documentation, from the Debian
         package ``python3.11-doc`` (``/usr/share/doc/python3.11/html/_sources``).  If that
         package is not installed, it is fetched by name with ``apt-get download`` into the
         cache directory and unpacked there with ``dpkg-deb -x`` (nothing is installed
         system-wide).  Licence: the package's ``copyright`` file (PSF licence).  Only
         prose paragraphs are kept: code examples, directives, tables and headings are
         dropped and inline markup is reduced to its text.
* prose (smoke only): the docstrings of the same standard-library modules, so that the
         smoke mode and the tests need neither the network nor the Debian package.

Splits are by document: a file goes to held-out when the first byte of the SHA-256 of
its relative path is below ``HELDOUT_FRACTION * 256``, so a split never depends on file-
system order, on the machine, or on which other files exist.

Run alone to print the sizes:  ``python training/corpus.py [--cache DIR] [--smoke]``.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_FRACTION = 0.06
PROSE_DOC_CHARS = 8000
DOC_PACKAGE = "python3.11-doc"
DOC_SOURCES = Path("usr/share/doc/python3.11/html/_sources")
DOC_COPYRIGHT = Path("usr/share/doc/python3.11-doc/copyright")
# Standard-library directories that hold test suites or bundled third-party data, not the
# library itself.
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "dist-packages"}


@dataclass
class Domain:
    """One domain of the corpus: documents (name, text) in a training and a held-out split."""

    name: str
    source: str
    licence: str
    licence_file: str
    train: list[tuple[str, str]] = field(default_factory=list)
    heldout: list[tuple[str, str]] = field(default_factory=list)

    def add(self, rel: str, text: str, limit_chars: int | None = None) -> bool:
        """Add a document to its split; with limit_chars, skip it once that split is full
        (held-out gets a fifth of the limit).  True once both splits are full."""
        held = is_heldout(rel)
        split = self.heldout if held else self.train
        if limit_chars is None:
            split.append((rel, text))
            return False
        caps = {True: limit_chars // 5, False: limit_chars}
        if sum(len(t) for _, t in split) < caps[held]:
            split.append((rel, text))
        return (sum(len(t) for _, t in self.train) >= caps[False]
                and sum(len(t) for _, t in self.heldout) >= caps[True])

    def sizes(self) -> dict[str, int]:
        return {
            "train_docs": len(self.train),
            "train_chars": sum(len(t) for _, t in self.train),
            "heldout_docs": len(self.heldout),
            "heldout_chars": sum(len(t) for _, t in self.heldout),
        }


def is_heldout(rel: str) -> bool:
    """Deterministic document-level split on the hash of the relative path."""
    return hashlib.sha256(rel.encode()).digest()[0] < int(HELDOUT_FRACTION * 256)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        out.append(p)
    return out


def read_source(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n")


def code_domain(limit_chars: int | None = None) -> Domain:
    root = stdlib_dir()
    lic = root / "LICENSE.txt"
    dom = Domain(
        name="code",
        source=f"CPython {sys.version.split()[0]} standard library, {root} "
               f"(*.py, excluding test suites and site-packages)",
        licence="PSF License Agreement (Python Software Foundation License Version 2)",
        licence_file=str(lic) if lic.exists() else "(LICENSE.txt not found beside the stdlib)",
    )
    for p in stdlib_files(root):
        text = read_source(p)
        if not text or not text.strip():
            continue
        if dom.add(str(p.relative_to(root)), text, limit_chars):
            break
    return dom


def docstring_domain(limit_chars: int | None = None) -> Domain:
    """English prose from standard-library docstrings (smoke mode; always available)."""
    root = stdlib_dir()
    lic = root / "LICENSE.txt"
    dom = Domain(
        name="prose",
        source=f"docstrings of the CPython {sys.version.split()[0]} standard library, {root}",
        licence="PSF License Agreement (Python Software Foundation License Version 2)",
        licence_file=str(lic),
    )
    for p in stdlib_files(root):
        text = read_source(p)
        prose = docstrings(text) if text else ""
        if prose and dom.add(str(p.relative_to(root)), prose, limit_chars):
            break
    return dom


def docstrings(source: str, min_chars: int = 80) -> str:
    """The docstrings longer than ``min_chars`` of a Python source (module, classes,
    functions), joined by blank lines; "" when it has none or does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d and len(d) > min_chars:
                docs.append(d)
    return "\n\n".join(docs)


def fetch_doc_package(cache: Path) -> Path:
    """Root under which DOC_SOURCES lies: / when installed, else an unpacked download."""
    if (Path("/") / DOC_SOURCES).is_dir():
        return Path("/")
    unpacked = cache / "debian" / DOC_PACKAGE
    if (unpacked / DOC_SOURCES).is_dir():
        return unpacked
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(
                f"the prose corpus needs the Debian package {DOC_PACKAGE}: install it "
                f"(apt-get install {DOC_PACKAGE}) or run on a Debian machine with {tool}")
    dl = cache / "debian" / "deb"
    dl.mkdir(parents=True, exist_ok=True)
    print(f"fetching Debian package {DOC_PACKAGE} with apt-get download ...", flush=True)
    r = subprocess.run(["apt-get", "download", "-q", DOC_PACKAGE], cwd=dl,
                       capture_output=True, text=True)
    debs = sorted(dl.glob(f"{DOC_PACKAGE}_*.deb"))
    if r.returncode != 0 or not debs:
        raise RuntimeError(f"apt-get download {DOC_PACKAGE} failed (run 'apt-get update' "
                           f"first?): {r.stderr.strip()[-500:]}")
    tmp = unpacked.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], check=True)
    tmp.rename(unpacked)
    return unpacked


def doc_package_version(root: Path, cache: Path) -> str:
    if root == Path("/"):
        r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", DOC_PACKAGE],
                           capture_output=True, text=True)
        return r.stdout.strip() or "unknown"
    debs = sorted((cache / "debian" / "deb").glob(f"{DOC_PACKAGE}_*.deb"))
    if debs:
        digest = hashlib.sha256(debs[-1].read_bytes()).hexdigest()
        return f"{debs[-1].name} (sha256 {digest})"
    return "unknown"


_ROLE = re.compile(r":[\w:+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")   # :role:`text <target>`
_LITERAL = re.compile(r"``([^`]*)``")
_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`_+")                      # `text <url>`_
_EMPH = re.compile(r"(?<![\w*])\*{1,2}([^*\n]+?)\*{1,2}(?![\w*])")
_REF = re.compile(r"`([^`]+)`_*")
_FOOT = re.compile(r"\s*\[(?:#\w*|\d+|\*)\]_")
_HEADING = re.compile(r"^([=\-~^*#+\"'`.:_])\1{2,}\s*$")


def rst_inline(text: str) -> str:
    text = _ROLE.sub(lambda m: m.group(1).strip(), text)
    text = _LITERAL.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _FOOT.sub("", text)
    text = _REF.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    return text


def rst_prose(rst: str) -> str:
    """Prose paragraphs of a reST file, reflowed to one line each, inline markup removed.

    A paragraph is kept when it starts at column 0, is not a directive/comment/table/list of
    fields, is not a heading, and reads like sentences (contains a space and a lowercase
    letter).  Indented blocks (code examples, directive bodies) are dropped whole."""
    paras = []
    for block in re.split(r"\n\s*\n", rst):
        lines = block.split("\n")
        if not lines or not lines[0] or lines[0][0].isspace():
            continue
        first = lines[0]
        if first.startswith(("..", "|", "+", "=", ":", ">>>")):
            continue
        if any(_HEADING.match(ln) for ln in lines):
            continue
        body = []
        for ln in lines:
            if ln[:1].isspace():        # an indented continuation (e.g. a code block) ends it
                break
            body.append(ln.strip())
        para = " ".join(body).strip()
        if para.endswith("::"):
            para = para[:-2].rstrip() + ":"
        para = rst_inline(para)
        if len(para) < 40 or not re.search(r"[a-z]{3,} [a-z]{2,}", para):
            continue
        paras.append(para)
    return "\n\n".join(paras)


def prose_domain(cache: Path) -> Domain:
    root = fetch_doc_package(cache)
    src = root / DOC_SOURCES
    lic = root / DOC_COPYRIGHT
    dom = Domain(
        name="prose",
        source=f"Python 3.11 documentation sources (reST, prose paragraphs only) from Debian "
               f"package {DOC_PACKAGE} {doc_package_version(root, cache)}",
        licence="PSF License Agreement (Python documentation; see the package's copyright file)",
        licence_file=(f"/{DOC_COPYRIGHT} in {DOC_PACKAGE}" if lic.is_file()
                      else f"(copyright file missing from {DOC_PACKAGE})"),
    )
    for p in sorted(src.rglob("*.txt")):
        rel = str(p.relative_to(src))
        if rel.startswith(("license", "copyright")):   # licence texts are not prose
            continue
        text = rst_prose(p.read_text(encoding="utf-8", errors="replace"))
        # Large files (the "What's New" pages) would make the held-out split lumpy: split
        # every file into documents of about PROSE_DOC_CHARS at paragraph boundaries.
        for i, chunk in enumerate(chunk_paragraphs(text, PROSE_DOC_CHARS)):
            if len(chunk) > 200:
                dom.add(f"{rel}#{i}", chunk)
    return dom


def chunk_paragraphs(text: str, size: int) -> list[str]:
    out, cur, n = [], [], 0
    for para in text.split("\n\n"):
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def build(cache: Path, smoke: bool = False, smoke_chars: int = 400_000) -> dict[str, Domain]:
    """Both domains.  smoke: a small slice of the code and docstring prose (no network)."""
    if smoke:
        return {"code": code_domain(limit_chars=smoke_chars),
                "prose": docstring_domain(limit_chars=smoke_chars)}
    return {"code": code_domain(), "prose": prose_domain(cache)}


def manifest(domains: dict[str, Domain]) -> dict:
    return {name: {"source": d.source, "licence": d.licence, "licence_file": d.licence_file,
                   "heldout_fraction": HELDOUT_FRACTION, **d.sizes()}
            for name, d in domains.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(__file__).resolve().parent / ".cache")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sample", choices=["code", "prose"], help="print the start of one "
                    "training document of this domain")
    args = ap.parse_args(argv)
    domains = build(args.cache, smoke=args.smoke)
    print(json.dumps(manifest(domains), indent=2))
    if args.sample:
        print(domains[args.sample].train[len(domains[args.sample].train) // 2][1][:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
