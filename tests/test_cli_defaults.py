"""The commands' flags default to their configs' defaults: a command given no flags runs with
`EngineConfig()`, `RouterConfig()` and `pdserve serve`'s `Deployment.served`."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.config import DECODE_CHUNK_SIZE, EngineConfig
from pdserve.engine.cli import engine_config_from_args
from pdserve.launch.commands import router_config_from_args
from pdserve.router.config import RouterConfig
from pdserve.sim.commands import deployment_of
from pdserve.sim.deployment import Deployment


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [("generate", "hi"), ("serve",), ("router",), ("worker", "--role", "both", "--router", "x")],
)
def test_engine_flags_default_to_engine_config(argv):
    assert engine_config_from_args(parse(*argv)) == EngineConfig()


@pytest.mark.parametrize("command", ["serve", "router"])
def test_router_flags_default_to_router_config(command):
    assert router_config_from_args(parse(command)) == RouterConfig()


@pytest.mark.parametrize(
    ("mode", "roles"), [("colocated", ["both"]), ("disagg", ["prefill", "decode"])]
)
def test_router_block_size_is_its_workers(mode, roles):
    """Each resolves its default by what it serves: the router's prefix hashes must match."""
    sizes = {EngineConfig(role=role).block_size for role in roles}
    assert sizes == {RouterConfig(mode=mode).block_size}
    assert EngineConfig(role=roles[0], block_size=32).block_size == 32


def test_serve_defaults_are_what_the_simulator_models():
    args = parse("serve")
    assert args.decode_chunk_size == DECODE_CHUNK_SIZE == Deployment.served("disagg").decode_chunk


def test_simulate_flags_default_to_deployment():
    args = parse("simulate", "--rate", "1")
    assert deployment_of(args) == Deployment()
