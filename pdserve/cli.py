"""The `pdserve` command. Each subcommand lives beside the code it drives.

Every module named in COMMAND_MODULES exposes `register(subparsers)`, which adds its
subcommands with `set_defaults(func=handler)`. Registering must stay cheap (argparse only):
heavy imports such as torch happen inside the handlers, so `pdserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "pdserve.engine.cli",  # generate
    "pdserve.launch.cli",  # serve, router, worker
    "pdserve.bench.cli",  # bench, bench compare
    "pdserve.sim.cli",  # kv-size, profile, simulate, plan
    "pdserve.kv_store.cli",  # store
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve LLMs with prefill and decode disaggregated (or co-located), "
        "benchmark them, and plan deployments.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module: surface it
                raise
            continue  # that part of the product is not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
