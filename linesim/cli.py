"""``callgate simulate``: write simulated calls in the corpus format.

Wired into ``gateway/cli.py`` by :func:`add_parser`; everything heavy is imported when the
command runs, not when the ``callgate`` parser is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="write simulated phone calls (labels, WAVs, Twilio messages)",
        description="Write simulated calls in the format of the development recordings, "
                    "deterministic per seed. Call i is under the i-th condition (cycling).")
    p.add_argument("out_dir", type=Path, help="folder to write NAME.wav/.bot.wav/.json/"
                                              ".twilio.jsonl into")
    p.add_argument("--split", choices=("train", "check"), required=True,
                   help="which voices and noise clips to use (check: reserved for checking)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=22, help="number of calls (default 22)")
    p.add_argument("--condition", action="append", default=None, metavar="NAME",
                   help="a condition name (erl20-d150-none-none-quiet-barge_in); repeatable; "
                        "default: the points of --grid")
    p.add_argument("--grid", default="small", help="small, impacts, mixed or full (default small)")
    p.add_argument("--voices", type=Path, default=None,
                   help="labelled recordings to cut real voices from (default tests/recordings)")
    p.set_defaults(fn=run)
    return p


def run(args: argparse.Namespace) -> int:
    from . import Condition, ConditionError, SourceError, VoiceLibrary, generate, grid

    try:
        if args.count < 1:
            raise ConditionError(f"--count must be at least 1, got {args.count}")
        conditions = ([Condition.parse(n) for n in args.condition] if args.condition
                      else grid(args.grid))
        library = VoiceLibrary(args.voices)
        written = generate(args.out_dir, split=args.split, seed=args.seed, count=args.count,
                           conditions=conditions, library=library)
    except (ConditionError, SourceError, ValueError, OSError) as exc:
        print(f"callgate simulate: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} calls ({args.split}, seed {args.seed}) to {args.out_dir}")
    return 0
