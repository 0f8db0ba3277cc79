"""`gapless` command line: serve, bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from gapless.bench.cli import add_bench_parser
    from gapless.server.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="gapless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
