"""What a plain greedy generate runs: the files of nanovllm/ (demo/ aside) with a line executed
inside a function, their lengths, and the nanovllm modules loaded, under coverage.

    python tools/plain_path.py [--json]

Prints one row per file (its lines, the lines that ran inside functions, its path), then the totals
and the modules loaded. Needs coverage (pip install coverage)."""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent


def function_lines(path: str) -> set[int]:
    """The line numbers inside function bodies (def lines run at import, not here)."""
    inside = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                inside.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return inside


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    cov = coverage.Coverage(data_file=None, source=[str(ROOT / "nanovllm")])
    cov.start()
    from nanovllm import LLM, SamplingParams
    llm = LLM("nanovllm:demo")
    llm.generate(["def add(a, b):", "import os"], SamplingParams(temperature=0, max_tokens=16),
                 use_tqdm=False)
    cov.stop()
    data, rows = cov.get_data(), []
    for path in data.measured_files():
        rel = Path(path).resolve().relative_to(ROOT / "nanovllm")
        ran = set(data.lines(path) or ()) & function_lines(path)
        if rel.parts[0] != "demo" and ran:
            rows.append((len(Path(path).read_text().splitlines()), len(ran), str(rel)))
    rows.sort(reverse=True)
    modules = sorted(m for m in sys.modules if m == "nanovllm" or m.startswith("nanovllm."))
    total = sum(r[0] for r in rows)
    if args.json:
        print(json.dumps({"files": len(rows), "lines": total, "rows": rows, "modules": modules}))
        return
    for lines, ran, rel in rows:
        print(f"{lines:5d} {ran:4d}  {rel}")
    print(f"{total} lines in {len(rows)} files; {len(modules)} nanovllm modules loaded:")
    print(" ".join(modules))
    llm.exit()


if __name__ == "__main__":
    main()
