"""Download, once, every wheel an install of specmoe needs into a folder (``make setup`` runs
this), so that tests/install/test_sdist.py installs the sdist into a fresh virtual environment
offline (``pip install --no-index --find-links FOLDER``).

What is downloaded is read from pyproject.toml: the build requirements, the dependencies and
the ``hf`` extra, constrained by requirements-dev.txt (the CPU build of torch; its lines with
extras left out, which pip refuses as constraints)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (requires-python): pip carries the same parser
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]


def requirements() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        meta = tomllib.load(f)
    return (meta["build-system"]["requires"] + meta["project"]["dependencies"]
            + meta["project"]["optional-dependencies"]["hf"] + ["wheel"])


def constraints(folder: str) -> str:
    """requirements-dev.txt as a constraints file in ``folder``: pip takes no extras in
    constraints (``ray[serve]``), so those lines are left out (none of them is in the hf
    extra this download serves)."""
    lines = [ln for ln in (ROOT / "requirements-dev.txt").read_text().splitlines()
             if "[" not in ln.split("#", 1)[0]]
    path = Path(folder) / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def main(dest: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest,
               "--constraint", constraints(tmp), *requirements()]
        return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / ".venv" / "wheelhouse")))
