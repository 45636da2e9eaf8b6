"""``python -m specmoe``: the command line (:mod:`specmoe.cli`)."""
from .cli import main

if __name__ == "__main__":
    import sys
    sys.exit(main())
