"""Command line: ``python -m specmoe <command>`` (also installed as ``specmoe``)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the main job on an embedded default")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
