"""`pdserve generate`: one completion from the command line, offline."""

from __future__ import annotations

import argparse

from pdserve.config import DTYPES, KV_CACHE_DTYPES, WEIGHT_FORMATS, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.flags import Flag, add_flags, config_values

# A table: a flag per entry, its help wrapped beside it (not one argument per line).
# fmt: off
ENGINE_FLAGS = (
    Flag.of(
        EngineConfig, "model", "GGUF file or Hugging Face folder "
        "(default: $PDSERVE_MODEL, else the bundled SmolLM2-135M-Instruct)",
    ),
    Flag.of(
        EngineConfig, "dtype", "auto = bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else "
        "float32", choices=DTYPES,
    ),
    Flag.of(EngineConfig, "device", "cpu, cuda, cuda:N (default: cuda if present)"),
    Flag.of(
        EngineConfig, "weights", "weight format of the linear layers: bf16 = unquantized, in "
        "--dtype; int8 = one scale per row; int4 = groups of 32 (a GGUF's Q4_0/Q4_1 blocks are "
        "used as they are). Quantized layers are used for decode steps of few sequences, the "
        "unquantized copy for prefills and big batches. auto (default): int4 on CPU when the "
        "file holds 4-bit blocks, else int8; bf16 on GPUs", choices=WEIGHT_FORMATS,
    ),
    Flag.of(
        EngineConfig, "int8_activations", "with int8/int4 weights on CPU, on: steps of more rows "
        "than the quantized kernels win at (prefills, big decode batches) run their layers' "
        "linears (not the lm_head) as int8 x int8 GEMMs (VNNI/AMX) on activations quantized per "
        "token, SmoothQuant-smoothed with ranges calibrated at load on a built-in text, wherever "
        "that measures faster here than the dense bf16 copy: SmolLM2 prefill chunks ~1.3x "
        "faster, held-text perplexity +0.5%% and some greedy answers change. off (default): the "
        "dense bf16 copy",
        choices=("off", "on"),
    ),
    Flag.of(
        EngineConfig, "enforce_eager", "decode with the eager PyTorch model instead of the fused "
        "C++ decode step (compiled once per machine at the first start, ~20-60 s, then cached); "
        "for debugging", action="store_true",
    ),
    Flag.of(
        EngineConfig, "kv_cache_gb", "KV cache size (default: 1 GiB on CPU; on a GPU a quarter of "
        "its total memory, at most 90%% of what is free)", type=float,
    ),
    Flag.of(
        EngineConfig, "kv_cache_dtype", "auto (default): K and V cached in --dtype; int8: each "
        "token's K and V rows as int8 values with a float32 scale per row and KV head (CPU, not "
        "MLA models): twice the tokens in the same --kv-cache-gb and half the bytes a decode "
        "step's attention reads (faster big batches), at the price of a small error in the "
        "attention over cached tokens. Prefill and decode workers must use the same",
        choices=KV_CACHE_DTYPES,
    ),
    Flag.of(
        EngineConfig, "block_size", "tokens per KV block, a power of two: prefix hits, the KV "
        "store and KV transfers go by whole blocks (default: 128 for a co-located engine, as "
        "vLLM's CPU backend, where decode steps over blocks that lie apart run ~10 %% faster "
        "than with 16; 16 for prefill and decode workers, whose prompts' KV crosses a link as "
        "whole blocks). Prefill and decode workers must use the same", type=int,
    ),
    Flag.of(
        EngineConfig, "chunk_size", "chunked prefill: tokens per step, running streams' "
        "included (default: a co-located or prefill worker 1024, so that prompts waiting under "
        "load get their first token after a bounded step and an abort stops a long prompt "
        "between chunks; `generate` whole prompts; 0 = whole prompts in one step)", type=int,
    ),
    Flag.of(EngineConfig, "max_num_seqs", "max sequences in a batch"),
    Flag.of(EngineConfig, "max_model_len", "context window (default: the model's)", type=int),
    # sets enable_prefix_caching, inverted (`engine_config_from_args`)
    Flag("--no-prefix-caching", action="store_true", help="disable prefix caching"),
    Flag.of(EngineConfig, "num_threads", "torch threads (default: torch's)", name="--threads",
            type=int),
    Flag.of(
        EngineConfig, "tensor_parallel_size", "run the engine as N ranks (processes), each with "
        "its share of the attention heads and MLP columns and of the KV cache (Megatron-style; "
        "gloo on CPU). The query heads and MLP width must divide by N (KV heads are replicated "
        "when N is a multiple of them); the threads and cores are shared among the ranks. A "
        "prefill worker of one size pushes into decode workers of any size: each decode rank "
        "receives its own KV heads (`pdserve serve --prefill-tp P --decode-tp D`). Not with a "
        "KV store (default 1)", metavar="N",
    ),
    Flag.of(
        EngineConfig, "expert_parallel_size", "Mixture-of-Experts models: split the experts over "
        "N groups of the engine's --tensor-parallel-size ranks (N divides it; each group holds "
        "num_experts / N whole experts, split by width over its ranks). Attention stays "
        "tensor-parallel and the KV cache is unchanged; every rank routes every token and one "
        "all-reduce after the MoE layer combines the experts' rows (default 1: every expert "
        "split by width over all ranks)", metavar="N",
    ),
    Flag.of(
        EngineConfig, "pipeline_parallel_size", "run the engine as N stages (processes), each "
        "holding consecutive layers and their KV cache (an even split, or --pp-layer-partition);"
        " a step's hidden states go stage to stage (gloo on CPU), and a long prompt's chunks "
        "flow through the stages one behind the other. A prefill worker pushes each stage's "
        "layers over a connection of that stage's own (`pdserve serve --prefill-pp P`). For "
        "prefill: refused for a decode worker. Not with --tensor-parallel-size or a KV store "
        "yet (default 1)", metavar="N",
    ),
    Flag.of(
        EngineConfig, "pp_layer_partition", "with --pipeline-parallel-size N: each stage's "
        "layer count, N counts adding up to the model's layers, e.g. 15,15 (default: even, "
        "the first stages one more when they do not divide)", metavar="COUNTS",
    ),
    Flag.of(
        EngineConfig, "speculative_config", "speculative decoding, as JSON with vLLM's fields: "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
        "\"prompt_lookup_max\": 5}' (prompt lookup), or '{\"method\": \"draft\", "
        "\"num_speculative_tokens\": 3, \"model\": \"DRAFT_DIR_OR_GGUF\"}' (a smaller model of "
        "the same vocabulary, with its own KV cache); optional \"disable_by_batch_size\" "
        "(default 2): no speculation in steps of more decoding sequences. Greedy outputs are the "
        "plain decoder's (a speculating step stays within the rows where the int4/int8 kernels "
        "give each row the same bits whatever the rows beside it); sampled ones keep their "
        "distribution (rejection sampling). Default: off",
        metavar="JSON",
    ),
)
# fmt: on


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate`, `worker` and `serve`."""
    add_flags(p, ENGINE_FLAGS)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = {**config_values(args, ENGINE_FLAGS), **overrides}
    return EngineConfig(enable_prefix_caching=not args.no_prefix_caching, **values)


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
