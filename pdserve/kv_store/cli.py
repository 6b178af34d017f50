"""`pdserve store`: run the KV store process (imports only argparse and the transport names
until the handler runs)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Run the KV cache store: one process per host that keeps KV blocks (keyed by the engines'
chained block hashes) in a DRAM tier and an SSD tier under --store-dir. When DRAM passes its
high watermark the least recently used blocks move to SSD; when SSD is full the least recently
used files are deleted. Every file carries a checksum; on restart the index is rebuilt from
the files and any torn or corrupt file is dropped. Workers reach it with
pdserve.kv_store.client.StoreClient at the endpoint printed on startup. With --transport nixl
block bytes move by NIXL READs (requests and replies stay on the socket) and the endpoint is
nixl://HOST:PORT; tcp clients are still served.
"""


def register(subparsers) -> None:
    from pdserve.kv_store.config import StoreConfig  # torch-free, as is the registry
    from pdserve.kv_transfer.registry import TRANSPORTS

    p = subparsers.add_parser(
        "store",
        help="run the KV cache store (DRAM + SSD tiers) for workers to offload and load blocks",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs a shared secret)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="port to bind (default 0: a free port, printed on startup)",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="tcp",
        help="how block bytes move: tcp (on the socket, default) or nixl (NIXL READs of "
        "registered memory; needs nixl-cu12); tcp clients are served either way",
    )
    p.add_argument(
        "--dram-gb",
        type=float,
        default=4.0,
        metavar="GB",
        help="capacity of the DRAM tier in GiB (default 4; 0: SSD only)",
    )
    p.add_argument(
        "--ssd-gb",
        type=float,
        default=32.0,
        metavar="GB",
        help="capacity of the SSD tier in GiB (default 32; 0: DRAM only)",
    )
    p.add_argument(
        "--store-dir",
        required=True,
        metavar="DIR",
        help="directory of the SSD tier (created if missing; reused on restart)",
    )
    p.add_argument(
        "--secret-file",
        metavar="FILE",
        help="file holding the shared secret clients must prove (HMAC); default "
        "$PDSERVE_SECRET or $PDSERVE_SECRET_FILE; required off loopback",
    )
    p.add_argument(
        "--high-watermark",
        type=float,
        default=StoreConfig.high_watermark,
        metavar="F",
        help="DRAM fill fraction that starts demotion to SSD "
        f"(default {StoreConfig.high_watermark:g})",
    )
    p.add_argument(
        "--low-watermark",
        type=float,
        default=StoreConfig.low_watermark,
        metavar="F",
        help=f"DRAM fill fraction demotion stops at (default {StoreConfig.low_watermark:g})",
    )
    p.add_argument(
        "--verify-on-start",
        action="store_true",
        help="checksum every SSD file at startup (default: header and size only; "
        "every read is checksummed either way)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="also serve Prometheus /metrics over HTTP on this port (off by default)",
    )
    p.set_defaults(func=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.kv_store.config import GB, StoreConfig
    from pdserve.kv_store.server import read_secret_file, serve_until_signalled

    config = StoreConfig(
        dram_bytes=int(args.dram_gb * GB),
        ssd_bytes=int(args.ssd_gb * GB),
        store_dir=Path(args.store_dir),
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        verify_on_start=args.verify_on_start,
    )
    secret = read_secret_file(args.secret_file) if args.secret_file else None
    return serve_until_signalled(
        config, args.host, args.port, secret, args.metrics_port, args.transport
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.kv_store.cli store ...`: the subcommand without the pdserve CLI."""
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
