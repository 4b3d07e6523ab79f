"""The notebooks: quickstart.ipynb runs headless (nbclient) on smoke sizes; every notebook's code is valid Python."""

from __future__ import annotations

import ast
import json
import os
import time

import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks")
QUICKSTART_BUDGET_S = 300  # what CI allows the quickstart, kernel start included


def _code_cells(name: str) -> list[str]:
    with open(os.path.join(NOTEBOOKS, name)) as handle:
        notebook = json.load(handle)
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


@pytest.mark.parametrize("name", ["quickstart.ipynb", "real_models.ipynb"])
def test_code_cells_are_python(name):
    cells = _code_cells(name)
    assert len(cells) >= 4
    for source in cells:
        ast.parse(source)  # no IPython magics: the cells run as plain Python anywhere


@pytest.mark.timeout(QUICKSTART_BUDGET_S + 60)
def test_quickstart_runs_headless_on_smoke_sizes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("FLEXMARL_NOTEBOOK_SMOKE", "1")  # the kernel inherits this process's environment
    notebook = nbformat.read(os.path.join(NOTEBOOKS, "quickstart.ipynb"), as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=QUICKSTART_BUDGET_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell errors
    assert time.monotonic() - started < QUICKSTART_BUDGET_S
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(output.get("output_type") != "error" for cell in code for output in cell.outputs)
    plots = [cell for cell in code if "plot" in cell.metadata.get("tags", [])]
    assert len(plots) == 2
    for cell in plots:
        assert any("image/png" in output.get("data", {}) for output in cell.outputs), cell.source
    (ask,) = [cell for cell in code if "ask" in cell.metadata.get("tags", [])]
    printed = "".join(output.get("text", "") for output in ask.outputs)
    assert printed.count("final answer:") == 2 and "solver:" in printed and "verifier:" in printed
    assert os.path.isfile(tmp_path / "runs" / "quickstart" / "metrics.jsonl")
