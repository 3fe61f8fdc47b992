"""How much of each exercise's answer the lesson already shows: for every exercise in ``notebooks/``, the
share of its reference solution's lines that appear in the code cells before the exercise's stub.

Lines are compared after normalising: comments, docstrings and blank lines dropped, names bound in the cell
(parameters, assignments, loop targets, functions, imports, ``self.`` attributes) replaced by ``_`` (so
renaming is no escape), whitespace removed. Lines with no content left (``return _``, ``else:``) and the
reference's own ``def`` lines are not counted. Usage: ``python scripts/exercise_overlap.py [notebooks...]``;
``--min 50`` lists only exercises at or above that share (exit status 1 if one is at 50 % or more).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB = re.compile(r"#\s*Exercise (\d+): your answer")
REFERENCE = re.compile(r"#\s*Reference solution to exercise (\d+)")
TRIVIAL = set(keyword.kwlist) | {"_", "True", "False", "None", "self"}
PUNCTUATION = {"(", ")", "[", "]", "{", "}", ",", ":", ".", "=", "->", ";"}


def python_only(source: str) -> str:
    """The cell without IPython magics (``%%cell`` and ``%line`` lines become blank)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def bound_names(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def docstring_lines(source: str) -> set[int]:
    """Line numbers (1-based) taken by docstrings."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def normalised_lines(source: str, skip_defs: bool = False) -> list[str]:
    """One normalised string per logical line with content."""
    source = python_only(source)
    local = bound_names(source) - set(dir(builtins))
    skip = docstring_lines(source)
    lines: dict[int, list[str]] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    start_of_logical = None
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
                        tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NEWLINE:
            start_of_logical = None
            continue
        if start_of_logical is None:
            start_of_logical = tok.start[0]
        if start_of_logical in skip:
            continue
        toks = lines.setdefault(start_of_logical, [])
        after_self = len(toks) >= 2 and toks[-1] == "." and toks[-2] == "self"
        local_name = tok.type == tokenize.NAME and (tok.string in local or after_self)
        toks.append("_" if local_name else tok.string)
    out = []
    for toks in lines.values():
        if skip_defs and toks[0] in ("def", "class"):
            continue
        if all(t in TRIVIAL or t in PUNCTUATION for t in toks):
            continue
        out.append("".join(toks))
    return out


def exercises(path: Path) -> list[tuple[int, float, int, int]]:
    """(exercise number, share, lines shown before, reference lines) for each exercise of a notebook."""
    cells = json.loads(path.read_text())["cells"]
    code = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    results = []
    for i, source in code:
        match = STUB.search(source)
        if not match:
            continue
        number = int(match[1])
        reference = next((s for _, s in code if (m := REFERENCE.search(s)) and int(m[1]) == number), None)
        if reference is None:
            continue
        before = {line for j, s in code if j < i for line in normalised_lines(s)}
        answer = normalised_lines(reference, skip_defs=True)
        shown = sum(line in before for line in answer)
        results.append((number, shown / len(answer) if answer else 0.0, shown, len(answer)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--min", type=float, default=0.0, help="list only shares >= this (%%)")
    args = parser.parse_args()
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    flagged = 0
    for path in paths:
        for number, share, shown, total in exercises(path):
            if share * 100 >= args.min:
                flagged += share >= 0.5
                name = f"{path.name[:2]} ex{number}"
                print(f"{name}: {100 * share:5.1f} %  ({shown} of {total} lines shown before)", flush=True)
    return 1 if args.min and flagged else 0


if __name__ == "__main__":
    sys.exit(main())
