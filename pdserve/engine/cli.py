"""`pdserve generate`: one completion from the command line, offline."""

from __future__ import annotations

import argparse

from pdserve.config import DTYPES, WEIGHT_FORMATS, EngineConfig
from pdserve.engine.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate`, `worker` and `serve`."""
    p.add_argument(
        "--model",
        default=EngineConfig.model,
        help="GGUF file or Hugging Face folder "
        "(default: $PDSERVE_MODEL, else the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=DTYPES,
        help="auto = bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32",
    )
    p.add_argument(
        "--device", default=EngineConfig.device, help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    p.add_argument(
        "--weights",
        default=EngineConfig.weights,
        choices=WEIGHT_FORMATS,
        help="weight format of the linear layers: bf16 = unquantized, in --dtype; int8 = one "
        "scale per row; int4 = groups of 32 (a GGUF's Q4_0/Q4_1 blocks are used as they are). "
        "Quantized layers are used for decode steps of few sequences, the unquantized copy "
        "for prefills and big batches. auto (default): int4 on CPU when the file holds 4-bit "
        "blocks, else int8; bf16 on GPUs",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode with the eager PyTorch model instead of the fused C++ decode step "
        "(compiled once per machine at the first start, ~20-60 s, then cached); for debugging",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=EngineConfig.kv_cache_gb,
        help="KV cache size (default: 1 GiB on CPU; on a GPU a quarter of its total memory, at "
        "most 90%% of what is free)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=EngineConfig.chunk_size,
        help="chunked prefill: per-step token budget (default: off, whole prompts)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help="max sequences in a batch",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=EngineConfig.max_model_len,
        help="context window (default: the model's)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--threads",
        type=int,
        default=EngineConfig.num_threads,
        help="torch threads (default: torch's)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=EngineConfig.tensor_parallel_size,
        metavar="N",
        help="run the engine as N ranks (processes), each with its share of the attention heads "
        "and MLP columns and of the KV cache (Megatron-style; gloo on CPU). The query heads and "
        "MLP width must divide by N (KV heads are replicated when N is a multiple of them); "
        "the threads and cores are shared among the ranks. A prefill worker of one size pushes "
        "into decode workers of any size: each decode rank receives its own KV heads "
        "(`pdserve serve --prefill-tp P --decode-tp D`). Not with a KV store (default 1)",
    )


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        weights=args.weights,
        enforce_eager=args.enforce_eager,
        kv_cache_gb=args.kv_cache_gb,
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        **overrides,
    )


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )
    llm = LLM(config=engine_config_from_args(args))
    try:
        if args.raw:
            out = llm.generate(args.prompt, params)
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
    finally:
        llm.engine.close()  # a tensor-parallel engine's other ranks
    print(out[0].text)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate one completion offline",
        description="Generate a completion for PROMPT in this process (no server). The chat "
        "template is applied unless --raw.",
    )
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument(
        "--temperature", type=float, default=SamplingParams.temperature, help="0 = greedy (default)"
    )
    p.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    p.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    p.add_argument(
        "--seed", type=int, default=SamplingParams.seed, help="makes sampling reproducible"
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template: complete PROMPT as is")
    add_engine_args(p)
    p.set_defaults(func=_generate)
