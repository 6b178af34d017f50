"""The fused C++ decode step (model/fused.py) against the eager model it replaces: same logits,
same K/V written, on batches of sequences with different context lengths and block tables."""

import pytest
import torch
from factories import make_engine, make_model_files, make_sequence, run_to_completion

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch

PROMPTS = [[5, 17, 33, 2, 9, 71, 8], list(range(1, 40)), [200, 3, 3, 3, 250, 1, 1, 7, 9, 90]]


def decode_batch(engine, prompts):
    """Prefill each prompt (eager: a prefill is never fused), append one token to each: the
    next step is one decode token per sequence, at three context lengths (3, 10 and 2 blocks
    of 4 tokens, the last block partly filled)."""
    seqs = [make_sequence(p, f"r{i}") for i, p in enumerate(prompts)]
    for seq in seqs:
        assert engine.block_manager.allocate(seq)
        engine.runner.run(ScheduledBatch([seq], [seq.num_tokens]))
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(7)
        assert engine.block_manager.append_slots(seq, 1)
    return ScheduledBatch(seqs, [1] * len(seqs))


@pytest.mark.parametrize(
    "dtype,tol,shape",
    [
        ("float32", 1e-4, {}),  # head_dim 16, GQA groups of 2 (a group in one pass)
        ("bfloat16", 0.1, {}),
        ("float32", 1e-4, dict(num_heads=8, num_kv_heads=1, hidden_size=256)),  # 8: per query
        ("float32", 1e-4, dict(num_heads=4, num_kv_heads=4, hidden_size=256)),  # 64, no GQA
        # head_dim 64, GQA groups of 3 (SmolLM2's): bf16 caches attend by vdpbf16ps where the
        # CPU has AVX512-BF16 (csrc/decode.cpp, namespace bf16), blocks of 4 and of 16 tokens
        # (a whole block a chunk of 16 keys, or the keys listed one by one)
        ("bfloat16", 0.1, dict(num_heads=6, num_kv_heads=2, hidden_size=384)),
        ("bfloat16", 0.1, dict(num_heads=6, num_kv_heads=2, hidden_size=384, block_size=16)),
        # a sliding window shorter than two of the prompts
        ("bfloat16", 0.1, dict(num_heads=6, num_kv_heads=2, hidden_size=384, sliding_window=9)),
        # head_dim 32 with GQA groups of 8 (a row's group over two items), and head_dim 128
        ("bfloat16", 0.1, dict(num_heads=16, num_kv_heads=2, hidden_size=512)),
        ("bfloat16", 0.1, dict(num_heads=4, num_kv_heads=2, hidden_size=512)),
        # 8-bit caches (model/kv_int8.py): logits within rounding, the rows written within a
        # quantization step (`_same_cache_rows`)
        ("float32", 1e-3, dict(kv_cache_dtype="int8")),
        (
            "bfloat16",
            0.1,
            dict(num_heads=6, num_kv_heads=2, hidden_size=384, kv_cache_dtype="int8"),
        ),
        (
            "bfloat16",
            0.1,
            dict(
                num_heads=6, num_kv_heads=2, hidden_size=384, block_size=16, kv_cache_dtype="int8"
            ),
        ),  # fmt: skip
        (
            "bfloat16",
            0.1,
            dict(
                num_heads=6,
                num_kv_heads=2,
                hidden_size=384,
                sliding_window=9,
                kv_cache_dtype="int8",
            ),
        ),  # fmt: skip
        (
            "bfloat16",
            0.1,
            dict(num_heads=4, num_kv_heads=2, hidden_size=512, kv_cache_dtype="int8"),
        ),
    ],
)
def test_fused_step_equals_eager_logits_and_kv(files, dtype, tol, shape):
    shape = dict(shape)
    block = {k: shape.pop(k) for k in ("block_size", "kv_cache_dtype") if k in shape}
    files = make_model_files(seed=1, **shape) if shape else files
    fused = make_engine(files, dtype=dtype, **block)
    eager = make_engine(files, dtype=dtype, enforce_eager=True, **block)
    assert fused.runner.fused is not None and eager.runner.fused is None
    outs = []
    for eng in (fused, eager):
        batch = decode_batch(eng, PROMPTS)
        rows, logits = eng.runner.run(batch)
        assert sorted(rows) == [0, 1, 2]  # eager returns them shortest context first
        logits = logits[torch.tensor(rows).argsort()]
        outs.append((logits, eng.runner.k_caches[1].clone(), eng.runner.v_caches[1].clone()))
    (lf, kf, vf), (le, ke, ve) = outs
    assert lf.shape == (3, files.config.vocab_size) and lf.dtype == torch.float32
    assert (lf - le).abs().max().item() < tol
    for f, e in ((kf, ke), (vf, ve)):  # the decode tokens' K/V too
        if f.dtype == torch.int8:
            _same_cache_rows(f, e, tol)
        else:
            assert (f.float() - e.float()).abs().max().item() < tol
    assert (lf.argmax(-1) == le.argmax(-1)).all()


def _same_cache_rows(fused: torch.Tensor, eager: torch.Tensor, tol: float) -> None:
    """8-bit cache rows: the values the two paths quantize differ as their unquantized K/V do
    (the fused RoPE rounds once where eager rounds per op), which can move a value across a
    rounding boundary or change a row's scale: within one and a half of its steps, plus tol."""
    from pdserve.model.kv_int8 import dequantize

    step = eager[..., -4:].contiguous().view(torch.float32)
    diff = (dequantize(fused, torch.float32) - dequantize(eager, torch.float32)).abs()
    assert (diff <= 1.5 * step + tol).all()


def test_fused_linears_in_onednn_layout_match_the_plain_weights(monkeypatch):
    """The fused step calls oneDNN's packed bf16 GEMM (csrc/decode.cpp onednn_linear) where
    the model holds its weights so (model/quant.py Dense.pack): the logits of the plain weights
    through at::linear, within bf16 rounding (the same bits on the Zen 4 it was written on)."""
    from pdserve.model import quant

    if not quant.onednn_packs(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("this CPU's oneDNN has no bf16 GEMM")
    files = make_model_files(seed=1, num_heads=6, num_kv_heads=2, hidden_size=384)
    packed = make_engine(files, dtype="bfloat16")
    monkeypatch.setattr(quant, "PACK_DENSE", False)
    plain = make_engine(files, dtype="bfloat16")
    assert packed.runner.model.lm_head.onednn and not plain.runner.model.lm_head.onednn
    logits = []
    for eng in (packed, plain):
        assert eng.runner.fused is not None
        rows, out = eng.runner.run(decode_batch(eng, PROMPTS))
        logits.append(out[torch.tensor(rows).argsort()])
    assert (logits[0] - logits[1]).abs().max().item() < 0.1
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


def test_a_prompt_chunked_one_token_a_step_samples_only_at_its_end(files):
    """chunk_size=1 makes every step one token per sequence: the fused step computes prompt
    tokens too, and returns logits only for sequences whose step reaches their last token."""
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = run_to_completion(make_engine(files, enforce_eager=True), PROMPTS, greedy)
    eng = make_engine(files, chunk_size=1)
    assert run_to_completion(eng, PROMPTS, greedy) == ref
    eng.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_hooked_steps_stay_eager(files):
    """A step with a layer hook (KV push) runs the eager model: the hook is called once per
    layer; the fused step is not entered."""
    eng = make_engine(files)
    calls = []
    eng.runner.fused = lambda *a: pytest.fail("a hooked step must not run fused")
    batch = decode_batch(eng, PROMPTS[:1])
    rows, _ = eng.runner.run(batch, layer_hook=calls.append)
    assert rows == [0] and calls == list(range(files.config.num_layers))


def test_a_mixed_step_runs_its_decodes_fused_and_its_prefill_chunk_eager(files):
    """Decodes beside a prompt's chunk: the decodes go through the fused step, the chunk
    through the eager model, in one step; each row gets the all-eager step's logits, and the
    indices still name the batch's own sequences."""
    outs = []
    for eng in (make_engine(files), make_engine(files, enforce_eager=True)):
        fused_rows = []
        if eng.runner.fused is not None:
            inner = eng.runner.fused
            eng.runner.fused = lambda *a, inner=inner, seen=fused_rows: (
                seen.append(len(a[0])) or inner(*a)
            )
        decodes = decode_batch(eng, PROMPTS[:2])
        prompt = make_sequence(PROMPTS[2], "new")
        assert eng.block_manager.allocate(prompt)
        batch = ScheduledBatch([decodes.seqs[0], prompt, decodes.seqs[1]], [1, 10, 1])
        rows, logits = eng.runner.run(batch)
        assert sorted(rows) == [0, 1, 2]
        outs.append(logits[torch.tensor(rows).argsort()])
        assert fused_rows == ([2] if eng.runner.fused is not None else [])
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    # torch's build lock is a plain file: a start killed while building leaves it, and torch
    # alone would wait on it forever. Held under the kernel lock, it is known stale and removed.
    import subprocess
    import sys

    from pdserve.model import extension as fused

    fused.load_extension()  # built (or loaded) here first
    (fused.build_dir() / "lock").touch()
    code = "from pdserve.model import extension as e; e.load_extension(); print(e.load_note)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("loaded in"), done.stdout
    assert not (fused.build_dir() / "lock").exists()


def test_a_changed_source_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """The build is cached in a folder named by a hash of decode.cpp: an edited source never
    loads the build of the one before."""
    from pdserve.model import extension as fused

    source = tmp_path / "decode.cpp"
    source.write_bytes(fused.SOURCE.read_bytes())
    monkeypatch.setattr(fused, "SOURCE", source)
    before = fused.build_dir()
    source.write_bytes(fused.SOURCE.read_bytes() + b"// edited\n")
    edited = fused.build_dir()
    source.write_bytes(source.read_bytes().removesuffix(b"// edited\n"))
    assert edited != before and fused.build_dir() == before


def test_an_edited_header_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """decode.cpp includes few_rows.h: the build's hash covers every file beside it."""
    from pdserve.model import extension as fused

    for part in fused.SOURCE.parent.iterdir():
        (tmp_path / part.name).write_bytes(part.read_bytes())
    monkeypatch.setattr(fused, "SOURCE", tmp_path / "decode.cpp")
    before = fused.build_dir()
    header = tmp_path / "few_rows.h"
    header.write_bytes(header.read_bytes() + b"// edited\n")
    assert fused.build_dir() != before


LONG = dict(num_heads=6, num_kv_heads=2, hidden_size=384, max_position_embeddings=1024)


@pytest.mark.parametrize(
    "block_size,window,shape,kv",
    [
        (4, None, {}, "auto"),
        (16, None, {}, "auto"),
        (16, 100, {}, "auto"),
        (4, 37, {}, "auto"),
        (16, None, dict(num_heads=16, hidden_size=512), "auto"),  # head_dim 32, groups of 8
        (16, 100, dict(num_heads=4, hidden_size=512), "auto"),  # head_dim 128
        (4, None, {}, "int8"),  # 8-bit caches: model/kv_int8.py
        (16, 100, {}, "int8"),
    ],
)
def test_a_verify_steps_rows_equal_plain_steps_bit_for_bit(
    monkeypatch, block_size, window, shape, kv
):
    verify_rows_equal_plain_steps(monkeypatch, block_size, window, shape, kv)


def verify_rows_equal_plain_steps(monkeypatch, block_size, window, shape, kv):
    """A sequence verifying 4 proposals is 5 rows of one block table in one fused step (their
    queries share the K/V rows read). Each row's logits are those of a step of that row alone,
    bit for bit, so greedy speculation emits plain decoding's tokens; over a context of many
    blocks and chunks of 16 keys, beside another sequence's row, whole or through a sliding
    window (each row's own). Int4 weights in bf16: the few-row kernel computes a row alike in
    any batch (forced: a machine's measured crossover could give a tiny shape the dense GEMM)."""
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "16")
    files = make_model_files(seed=3, **{**LONG, **shape}, sliding_window=window)
    eng = make_engine(files, dtype="bfloat16", weights="int4", kv_cache_gb=0.02,
                      block_size=block_size, kv_cache_dtype=kv)  # fmt: skip
    assert eng.runner.fused is not None
    seqs = []
    for i, n in enumerate((300, 45)):
        seq = make_sequence([(t * 7 + i) % 250 + 1 for t in range(n)], f"r{i}")
        assert eng.block_manager.allocate(seq)
        eng.runner.run(ScheduledBatch([seq], [seq.num_tokens]))
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.extend([11, 12, 13, 14, 15][: 5 if i == 0 else 1])
        assert eng.block_manager.append_slots(seq, seq.num_tokens)
        seqs.append(seq)
    bs = eng.runner.block_size
    rows = []  # (token, position, sequence): the verify's 5 rows, then the other's one
    for seq in seqs:
        for p in range(seq.num_computed_tokens, seq.num_tokens):
            rows.append((seq.token_ids[p], p, seq))
    width = max(len(s.block_table) for s in seqs)

    def step(sel):
        picked = [rows[i] for i in sel]
        return eng.runner.fused(
            torch.tensor([token for token, _, _ in picked]),
            torch.tensor([p for _, p, _ in picked]),
            torch.tensor([s.block_table[p // bs] * bs + p % bs for _, p, s in picked]),
            torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for *_, s in picked]),
            torch.tensor([p + 1 for _, p, _ in picked]),
        )

    together = step(range(6))
    alone = torch.cat([step([i]) for i in range(6)])
    assert torch.equal(together, alone)
    assert torch.isfinite(together).all() and together.std() > 0
    return eng


def test_the_int4_amx_kernel_gives_verify_rows_the_bits_of_plain_steps(monkeypatch):
    """As above with the int4 linears on their AMX kernel (csrc/few_rows.h `mm_amx`) from one
    row on: the fused step's Linear is given the rows it runs from (`amx_from`), and a row's
    logits are its own whatever the rows beside it."""
    from pdserve.model import kernel_rows, quant
    from pdserve.model.extension import load_extension

    if not load_extension().amx_available():
        pytest.skip("this CPU (or build) has no AMX-BF16 tiles")
    monkeypatch.setattr(kernel_rows.KernelRows, "amx_from", lambda self, *a, **k: 1)
    eng = verify_rows_equal_plain_steps(monkeypatch, 16, None, {}, "auto")
    linears = [lin for lin in quant.quantized_linears(eng.runner.model) if lin.kind == 3]
    assert linears and all(lin.kernel_spec()[-1] == 1 for lin in linears)


def test_bf16_caches_attend_by_avx512_bf16_where_the_cpu_has_it():
    """The tests above run the bf16 kernel (csrc/decode.cpp, namespace bf16) on a CPU with
    AVX512-BF16, and the portable one elsewhere: the build follows the CPU (-march=native)."""
    from pdserve.model.extension import cpu_flags, load_extension

    assert load_extension().bf16_attention() == ("avx512_bf16" in cpu_flags().split())


def _short_prompt_engines(monkeypatch, files=None, **overrides):
    """A bf16 int4 engine whose linears serve up to 64 rows and count as the file's own blocks
    (`Int4Linear.stored`; these tiny weights are quantized at load), and its eager twin. On a
    CPU with AMX the twin gives a prompt's rows the same int4 weights on the same AMX kernel;
    without, both give them the dense weight (the fused step's `exact` rows, quant.prompt_rows),
    whatever the weights. The fused step's prompt rows are then the eager model's but for the
    fused step's roundings."""
    from pdserve.model import kernel_rows, quant
    from pdserve.model.extension import load_extension

    amx = load_extension().amx_available()
    monkeypatch.setenv("PDSERVE_QUANT_MAX_ROWS", "64")
    if amx:
        monkeypatch.setattr(kernel_rows.KernelRows, "amx_from", lambda self, *a, **k: 1)
        monkeypatch.setattr(quant, "FEW_ROWS_FOR_PROMPTS", True)
    files = files or make_model_files(seed=4, **LONG)
    shape = dict(dtype="bfloat16", weights="int4", kv_cache_gb=0.02, block_size=16, **overrides)
    fused, eager = make_engine(files, **shape), make_engine(files, enforce_eager=True, **shape)
    # weights quantized at load are not a prompt's on AMX tiles; without AMX, no matter
    assert bool(fused.runner.fused_prompt_rows) != amx
    for lin in quant.quantized_linears(fused.runner.model):
        lin.stored = True
    fused.runner.fused_prompt_rows = fused.runner._fused_prompt_rows()
    return fused, eager


def _prompt_calls(eng) -> list[int]:
    """The rows of each fused call the engine makes with prompt=True, as it makes them."""
    calls, inner = [], eng.runner.fused

    def fused(*args, prompt=False, **kw):
        if prompt:
            calls.append(len(args[0]))
        return inner(*args, prompt=prompt, **kw)

    eng.runner.fused = fused
    return calls


def _first_logits(eng, prompts):
    """Each prompt's first-token logits from one step of them all, and layer 1's K cache."""
    seqs = [make_sequence(p, f"r{i}") for i, p in enumerate(prompts)]
    for seq in seqs:
        assert eng.block_manager.allocate(seq)
    rows, logits = eng.runner.run(ScheduledBatch(seqs, [s.num_tokens for s in seqs]))
    assert sorted(rows) == list(range(len(prompts)))
    return logits[torch.tensor(rows).argsort()], eng.runner.k_caches[1].clone()


def test_prompts_alone_run_the_fused_step_on_bf16_rows(monkeypatch):
    """A step of prompt chunks alone runs the fused step (ModelRunner._prompts_alone): every
    linear on its AMX kernel up to its rows (bf16 rows, as the eager model keeps a prompt's,
    quant.prompt_rows; without AMX on none) and on the dense weight beyond, each run of 32
    rows or more attending by the prompt attention kernel (csrc/decode.cpp `attend_run`;
    shorter ones row by row). Its logits and the K/V it writes are the eager prefill's within
    bf16 rounding, and only the sampled rows get logits. Asking for prompt logprobs, a prompt
    keeps the eager model; beside a decode it is a fused call of its own, after the decode's."""
    fused, eager = _short_prompt_engines(monkeypatch)
    assert fused.runner.fused_prompt_rows == fused.runner.config.max_num_batched_tokens
    calls = _prompt_calls(fused)
    long = [(t * 5) % 250 + 1 for t in range(300)]  # past the 64 rows: the dense weights
    for prompts in (PROMPTS, [long]):
        (lf, kf), (le, ke) = _first_logits(fused, prompts), _first_logits(eager, prompts)
        assert lf.shape == (len(prompts), fused.model_config.vocab_size)
        assert (lf - le).abs().max().item() < 0.1 and (lf.argmax(-1) == le.argmax(-1)).all()
        assert (kf.float() - ke.float()).abs().max().item() < 0.05
    assert calls == [sum(len(p) for p in PROMPTS), len(long)]

    logprobs = make_sequence(PROMPTS[0], "lp", prompt_logprobs=1)
    assert fused.block_manager.allocate(logprobs)
    fused.runner.run(ScheduledBatch([logprobs], [logprobs.num_tokens]))
    assert len(calls) == 2
    decode = decode_batch(fused, PROMPTS[:1])  # its prefill: a prompt alone
    assert calls[2:] == [len(PROMPTS[0])]
    prompt = make_sequence(PROMPTS[2], "beside")
    assert fused.block_manager.allocate(prompt)
    rows, _ = fused.runner.run(ScheduledBatch([decode.seqs[0], prompt], [1, prompt.num_tokens]))
    assert sorted(rows) == [0, 1] and calls[3:] == [prompt.num_tokens]  # split: two calls


def test_without_the_prompt_kernel_only_short_prompts_run_fused(monkeypatch):
    """With a sliding window (the prompt attention kernel has none) a prompt's rows would go
    one by one through the decode attention: the fused step takes prompts of up to the
    linears' rows (64), longer ones the eager model."""
    files = make_model_files(seed=4, **LONG, sliding_window=40)
    fused, eager = _short_prompt_engines(monkeypatch, files)
    assert fused.runner.fused_prompt_rows == 64
    calls = _prompt_calls(fused)
    short, long = PROMPTS[1], [(t * 5) % 250 + 1 for t in range(65)]
    for prompts in ([short], [long]):
        (lf, _), (le, _) = _first_logits(fused, prompts), _first_logits(eager, prompts)
        assert (lf - le).abs().max().item() < 0.1
    assert calls == [len(short)]


@pytest.mark.parametrize(
    "chunk,length,chunks",
    [(8, 39, [8, 8, 8, 8, 7]), (40, 100, [40, 40, 20])],  # rows one by one; runs of 40 by
)  # the prompt kernel over the cached chunks before them (gathered from the blocks)
def test_a_prompt_in_fused_chunks_gives_the_eager_tokens(monkeypatch, chunk, length, chunks):
    """Chunks (the first ones sample nothing: no logits asked for) and the decodes after: the
    eager engine's greedy tokens, every block given back."""
    fused, eager = _short_prompt_engines(monkeypatch, chunk_size=chunk)
    calls = _prompt_calls(fused)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [[(t * 11 + 3) % 250 + 1 for t in range(length)]]
    assert run_to_completion(fused, prompt, greedy) == run_to_completion(eager, prompt, greedy)
    assert calls == chunks
    fused.check_integrity()
    assert fused.block_manager.num_free_blocks == fused.block_manager.num_blocks


def test_prompts_alone_take_int8_activations_where_the_model_has_them(monkeypatch):
    """With --int8-activations on, a prompt's rows past the AMX kernel's go to the int8 GEMM in
    the fused step as in the eager model (they went to the dense weight, silently dropping the
    option for a step of prompts alone): the same logits within rounding, and apart from the
    dense product's."""
    from pdserve.model import quant
    from pdserve.model.fused import FusedDecode

    monkeypatch.setenv("PDSERVE_INT8_ACT_ROWS", "100000")
    fused, eager = _short_prompt_engines(monkeypatch, int8_activations="on")
    assert fused.runner.fused_prompt_rows and fused.runner.activations.startswith("int8")
    qkv = fused.runner.model.layers[0].attn.qkv
    assert tuple(qkv.a8_rows) == (65, 100000)
    long = [[(t * 5) % 250 + 1 for t in range(300)]]  # past the 64 rows: int8 activations
    (lf, kf), (le, ke) = _first_logits(fused, long), _first_logits(eager, long)
    for eng in (fused, eager):
        for lin in quant.quantized_linears(eng.runner.model, head=False):
            lin.a8_rows = (0, 0)  # the dense weight beyond 64 rows
    fused.runner.fused = FusedDecode(fused.runner.model, fused.runner.kv_caches)
    (ld, _), (led, _) = _first_logits(fused, long), _first_logits(eager, long)
    near, dense = (lf - le).abs().max().item(), (lf - ld).abs().max().item()
    assert (led - ld).abs().max().item() < 0.1  # the two paths agree without them too
    assert near < 0.1 and (kf.float() - ke.float()).abs().max().item() < 0.05
    assert dense > 2 * near, (near, dense)


def test_a_prompt_steps_last_layer_carries_only_the_rows_that_sample(monkeypatch):
    """A step of prompts takes only its sampled rows past its last layer's attention (nothing
    reads the others' results there): their logits are those the step gives with every row
    carried, each row computed alone by the same kernels, and every row's K/V is written."""
    fused, _ = _short_prompt_engines(monkeypatch)
    calls, inner = [], fused.runner.fused

    def recording(*args, **kw):  # the runner's call, to make again with every row carried
        calls.append((args, kw))
        return inner(*args, **kw)

    fused.runner.fused = recording
    kept, _ = _first_logits(fused, PROMPTS)  # 56 rows: every kernel as for 3 (few rows to 64)
    ((args, kw),) = calls
    keep = kw["keep"]
    assert kw["prompt"] and kept.shape == (len(PROMPTS), fused.model_config.vocab_size)
    last = fused.runner.k_caches[-1]
    cache = last.clone()
    last.zero_()
    every = inner(*args, prompt=True)  # every row carried: (rows, vocab)
    # the same kernels on the same rows: bit for bit here (Zen 4), where oneDNN computes a row
    # alone; its lm_head as for the kept rows (56 rows and 3 take the same kernel)
    assert (kept - every[keep]).abs().max().item() < 1e-2
    assert (kept.argmax(-1) == every[keep].argmax(-1)).all()
    assert torch.equal(last, cache)  # the last layer's K/V of every row, as the trimmed step's
    last.zero_()
    none = inner(*args, keep=keep[:0], prompt=True)
    assert none.numel() == 0 and torch.equal(last, cache)
