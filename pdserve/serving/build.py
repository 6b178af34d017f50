"""`build_worker`: a worker's wiring, in its order, apart from the loop that runs it.

engine (warmed up, so the warm-up moves no KV) -> its KV layout -> host staging (a GPU cache, or
PDSERVE_KV_STAGING) -> the role's side: a prefill worker's KV sender and `PrefillSide`, or a
decode worker's receiver (one per tensor-parallel rank) and `DecodeSide` (a pipeline's prefill
worker: a sender per stage) -> the KV store link ->
the engine's one connector (store first: a prefix it loads is not pushed) -> the load reporter.
"""

from __future__ import annotations

from pdserve import envs, tracing
from pdserve.engine.kv_connector import combine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_store.mooncake import open_store_client
from pdserve.kv_transfer import KVLayout, KVReceiver, KVSender, make_receiver, make_sender
from pdserve.kv_transfer.group import ReceiverGroup
from pdserve.kv_transfer.stage_link import LinkSpec, StageLink, stage_caches
from pdserve.kv_transfer.stage_senders import StageSenders
from pdserve.protocol.channel import Codec, require_secret_for, resolve_secret
from pdserve.serving.decode_side import DecodeSide
from pdserve.serving.kv_staging import HostStaging
from pdserve.serving.load_report import LoadProbe, LoadReporter
from pdserve.serving.prefill_side import PrefillSide
from pdserve.serving.router_link import Routers
from pdserve.serving.store_link import StoreLink
from pdserve.serving.worker import Worker
from pdserve.serving.worker_config import WorkerConfig


def build_worker(config: WorkerConfig, engine: LLMEngine | None = None) -> Worker:
    """A worker ready to `run`: `engine` (tests pass a tiny one), else one of config.engine."""
    engine = engine or LLMEngine(config.engine)
    engine.warm_up()
    runner, role = engine.runner, config.engine.role
    tracing.setup(f"pdserve-{role}", **{"pdserve.worker_id": config.worker_id})
    if config.kv_store and runner.device.type != "cpu":
        raise ValueError(
            f"the KV store (--kv-store) moves blocks of a host-memory KV cache; this worker's "
            f"cache is on {runner.device}: run it without --kv-store, or with --device cpu"
        )
    layout = kv_layout(engine)
    secret = resolve_secret()
    routers = Routers(config.routers, config.worker_id, Codec(secret))
    staging, ranks = host_staging(engine, role)
    decode = prefill = store = None
    if role == "prefill":
        sender = prefill_sender(config, engine, layout, ranks)
        prefill = PrefillSide(engine, sender, routers.send, config.transfer_timeout_s, staging,
                              whole=config.kv_push == "whole")  # fmt: skip
    else:
        receiver = None
        if role == "decode":
            require_secret_for(config.kv_host, secret)
            receiver = kv_receiver(config, layout, ranks)
            receiver.start()
        decode = DecodeSide(engine, layout, routers.send, config.worker_id, receiver, staging)
    if config.kv_store:
        check_store(config, engine)
        client = open_store_client(config.kv_store, layout, runner.k_caches, runner.v_caches)
        store = store_link(client, engine, role)
        if decode is not None and tracing.enabled():  # store hits and misses in its traces
            store.lookups, decode.store = {}, store
    connectors = [store, prefill, decode if decode and decode.receiver else None]
    engine.connect(combine([c for c in connectors if c is not None]))
    probe = LoadProbe(engine, store, staging, decode)
    reporter = LoadReporter(config.worker_id, config.routers, routers.codec, probe)
    return Worker(config, engine, layout, routers, reporter,
                  decode=decode, prefill=prefill, store=store)  # fmt: skip


def prefill_sender(config: WorkerConfig, engine: LLMEngine, layout: KVLayout, ranks) -> KVSender:
    """The prefill worker's KV sender (reading every rank's caches: `ranks`). A pipeline's
    is one sender per stage (`StageSenders`), each in its stage's process, on its own caches
    and connections, sending only its stage's layers: stage 0's here, each later stage's
    driven through a `StageLink`."""
    pp = engine.runner.pp
    if pp is None:
        group = {"ranks": ranks} if len(ranks) > 1 else {}
        return make_sender(config.kv_transport, layout, *ranks[0],
                           compression=config.compression, **group)  # fmt: skip
    held = [stage_caches(k, v, pp.held) for k, v in ranks]  # each TP rank's, of a stage's
    mine = make_sender(config.kv_transport, layout, *held[0], compression=config.compression,
                       **({"ranks": held} if len(held) > 1 else {}))  # fmt: skip
    addresses = pp.open_links(LinkSpec(config.kv_transport, layout, config.compression))
    blocks = engine.runner.num_blocks  # every stage's cache has as many as stage 0's
    pp.links = [StageLink(s, a, pp.queue_push, blocks) for s, a in enumerate(addresses, start=1)]
    return StageSenders([mine, *pp.links], pp.layers)


def store_link(client, engine: LLMEngine, role: str) -> StoreLink:
    """The worker's link to the KV store over `client` (made on the engine's caches). A
    pipeline's stage 0 holds every layer's cache (the later stages' in shared memory), so its
    link moves whole blocks, once the later stages have run every step sent to them."""
    pp = engine.runner.pp
    return StoreLink.for_role(client, engine.block_manager, role, pp.drain if pp else None)


def check_store(config: WorkerConfig, engine: LLMEngine) -> None:
    """Refuse the KV store for a pipeline whose stages' caches stage 0 cannot reach (Ray
    placed them: `engine/pp/ray_stages.py`): its link moves every layer from stage 0."""
    pp = engine.runner.pp
    if config.kv_store and pp is not None and not pp.shared:
        raise ValueError(
            "--kv-store with a pipeline whose stages Ray placed (--launcher ray --prefill-pp): "
            "the store link moves every layer's blocks from stage 0, which reaches the other "
            "stages' caches only on one host; run without --kv-store, or with --launcher local"
        )
    if config.kv_store and pp is not None and engine.runner.tp is not None:
        raise ValueError(
            "--kv-store with a pipeline of tensor-parallel stages: the store link moves whole "
            "blocks of one rank's cache per stage; drop --kv-store, or the stages' TP"
        )


def kv_layout(engine: LLMEngine) -> KVLayout:
    """Rank 0's layout: a tensor-parallel group's ranks each hold their share of the heads
    (an MLA latent, one "head", is whole on every rank). A head's row is the cache tensor's:
    `head_dim` + 4 bytes of an int8 cache (`model/kv_int8.py`)."""
    runner, mc = engine.runner, engine.model_config
    kv = mc.kv_shape()  # the model's: K and V of every KV head, or the latent
    return KVLayout(
        model_fingerprint=engine.fingerprint,
        dtype=str(runner.cache_dtype).removeprefix("torch."),
        num_layers=mc.num_layers,
        block_size=engine.config.block_size,
        num_kv_heads=kv.heads,
        head_dim=runner.cache_dim,
        cache="latent" if kv.is_latent else "heads",
    ).split(engine.config.tensor_parallel_size)


def host_staging(engine: LLMEngine, role: str) -> tuple[HostStaging | None, list]:
    """(staging, every rank's (K, V) caches the connectors move). The connectors move host
    memory: a GPU cache's transfers are staged through pinned host blocks."""
    runner = engine.runner
    ranks = runner.rank_caches
    if role == "both" or (runner.device.type == "cpu" and not envs.kv_staging()):
        return None, ranks
    if len(ranks) > 1:
        raise ValueError(
            "host staging of KV transfers (a GPU cache, or PDSERVE_KV_STAGING) moves "
            "one rank's cache: run tensor-parallel workers on CPU without it"
        )
    staging = HostStaging.sized(*ranks[0], engine.max_model_len)
    return staging, [(staging.k_caches, staging.v_caches)]


def kv_receiver(config: WorkerConfig, layout: KVLayout, ranks) -> KVReceiver:
    """One receiver per rank (its own endpoint; it writes that rank's cache, its heads)."""
    receivers = [
        make_receiver(config.kv_transport, layout.shard(r), k, v, config.kv_host)
        for r, (k, v) in enumerate(ranks)
    ]
    return receivers[0] if len(receivers) == 1 else ReceiverGroup(receivers)
