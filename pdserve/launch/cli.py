"""The parsers of `pdserve serve`, `pdserve router` and `pdserve worker` (argparse only, cheap to
import): their flags are the tables of `launch/flags.py` and the engine's (`engine/cli.py`);
what each command does is in `launch/commands.py`."""

from __future__ import annotations

from pdserve.engine.cli import add_engine_args
from pdserve.flags import add_flags
from pdserve.launch import commands
from pdserve.launch.flags import (
    AUTOSCALE_FLAGS,
    POOL_FLAGS,
    SERVE_FLAGS,
    WORKER_FLAGS,
    router_flags,
)


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start the router and workers on this machine",
        description="Start the OpenAI-compatible router and its workers on this machine. "
        "Default: disaggregated, one prefill worker and one decode worker, one core each, "
        "with the bundled model. Prints the URL and an example curl when ready.",
    )
    add_flags(p, router_flags())
    add_engine_args(p)
    add_flags(p, POOL_FLAGS)
    g = p.add_argument_group(
        "autoscaling (--mode disagg, either launcher; docs/serving.md#autoscaling)"
    )
    add_flags(g, AUTOSCALE_FLAGS)
    add_flags(p, SERVE_FLAGS)
    p.set_defaults(func=commands.serve)

    p = sub.add_parser("router", help="start only the router (workers join with `pdserve worker`)")
    add_flags(p, router_flags())
    add_engine_args(p)
    p.set_defaults(func=commands.router)

    p = sub.add_parser(
        "worker",
        help="start one engine worker that joins a router",
        description="One engine process with a role. It registers with the router, "
        "heartbeats, and serves requests the router places on it.",
    )
    add_flags(p, WORKER_FLAGS)
    add_engine_args(p)
    p.set_defaults(func=commands.worker)
