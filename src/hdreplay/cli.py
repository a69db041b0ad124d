"""The ``hdreplay`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hdreplay", description="Headroom-Drift Replay for GRPO")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show the replay primitive working")
    demo.add_argument("--steps", type=int, default=6)
    demo.add_argument("--selector", default="headroom_drift")
    args = ap.parse_args(argv)
    if args.command == "demo":
        from .synthetic import walkthrough

        walkthrough(steps=args.steps, selector=args.selector)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
