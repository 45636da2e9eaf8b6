"""Download, once, every wheel an install of specmoe needs into a folder (``make setup`` runs
this), so that tests/install/test_sdist.py installs the sdist into a fresh virtual environment
offline (``pip install --no-index --find-links FOLDER``).

What is downloaded is read from pyproject.toml: the build requirements, the dependencies and
the ``hf`` extra, constrained by requirements-dev.txt (the CPU build of torch)."""
from __future__ import annotations

import subprocess
import sys
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


def main(dest: str) -> int:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", dest,
           "--constraint", str(ROOT / "requirements-dev.txt"), *requirements()]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / ".venv" / "wheelhouse")))
