"""No pickle, marshal, eval or exec anywhere in the package: network data is only ever decoded
by typed msgspec decoders. Checked on the syntax tree (so comments and docstrings that say
"never unpickled" do not count) and on the raw names used."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pdserve

PACKAGE = Path(pdserve.__file__).parent
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}
UNSAFE_CALLS = {"eval", "exec", "compile"}
UNSAFE_ATTRS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("np", "load")}


def sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20  # the package, not an empty directory
    return files


def findings(path: Path) -> list[str]:
    text = path.read_text()
    where = path.name if PACKAGE not in path.parents else path.relative_to(PACKAGE.parent)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string in UNSAFE_MODULES:
            out.append(f"{where}:{tok.start[0]}: uses {tok.string}")
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
            out.append(f"{where}:{node.lineno}: calls {f.id}()")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if (f.value.id, f.attr) in UNSAFE_ATTRS:
                out.append(f"{where}:{node.lineno}: calls {f.value.id}.{f.attr}()")
            if f.attr == "loads" and f.value.id in UNSAFE_MODULES:
                out.append(f"{where}:{node.lineno}: calls {f.value.id}.loads()")
    return out


def test_no_pickle_marshal_eval_or_exec_in_the_package():
    assert [f for path in sources() for f in findings(path)] == []


def test_the_scanner_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle  # noqa\n"
        "x = eval(data)\n"
        "exec(code)\n"
        "import torch\n"
        "t = torch.load(f)\n"
        "model.eval()  # a method: fine\n"
        '"""pickle in a docstring is fine"""\n'
    )
    assert [f.split(": ", 1)[1] for f in findings(bad)] == [
        "uses pickle",
        "calls eval()",
        "calls exec()",
        "calls torch.load()",
    ]
