"""The `zppc` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zppc", description=__doc__)
    parser.add_argument("--version", action="store_true")
    args = parser.parse_args(argv)
    if args.version:
        import zppc

        print(zppc.__version__)
    return 0
