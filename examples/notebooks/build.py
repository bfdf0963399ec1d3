"""Build the notebooks from their percent-format sources, so that what is reviewed is plain Python.

python examples/notebooks/build.py            # rewrite every NN_name.ipynb from NN_name.py
python examples/notebooks/build.py --check    # exit 1 if a committed notebook differs from its source

A source is Python with cell markers: ``# %%`` opens a code cell, ``# %% [markdown]`` a markdown cell
whose lines are comments (``# `` is stripped). Lines before the first marker (the module docstring, lint
pragmas) stay out of the notebook. Notebooks are written without outputs and with stable cell ids, so
building twice gives the same bytes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
MARKER = re.compile(r"^# %%(?P<markdown> \[markdown\])?\s*$")


def sources() -> list[Path]:
    return sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))


def _strip_blank(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def _markdown(lines: list[str]) -> str:
    out = []
    for line in lines:
        if line.strip() and not line.startswith("#"):
            raise ValueError(f"a markdown cell line must be a comment, got {line!r}")
        out.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(out)


def notebook(source: Path) -> nbformat.NotebookNode:
    """The notebook for one percent-format source."""
    cells: list[tuple[bool, list[str]]] = []
    for line in source.read_text().splitlines():
        match = MARKER.match(line)
        if match:
            cells.append((bool(match["markdown"]), []))
        elif cells:
            cells[-1][1].append(line)
    if not cells:
        raise ValueError(f"{source} has no '# %%' cell marker")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for index, (is_markdown, lines) in enumerate(cells):
        lines = _strip_blank(lines)
        if is_markdown:
            cell = nbformat.v4.new_markdown_cell(_markdown(lines))
        else:
            cell = nbformat.v4.new_code_cell("\n".join(lines))
        cell.id = f"{source.stem}-{index:02d}"  # stable: a rebuild changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(source: Path) -> str:
    return nbformat.writes(notebook(source)) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for source in sources():
        target = source.with_suffix(".ipynb")
        text = render(source)
        if target.exists() and target.read_text() == text:
            continue
        if check:
            stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parents[1])}")
    if stale:
        print(f"stale notebooks (run python examples/notebooks/build.py): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
