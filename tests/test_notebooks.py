"""Every lesson is a valid notebook of nbformat 4.5: each cell has a unique id, which
JupyterLab and nbval use to tell cells apart (a 4.5 notebook without them is invalid, and
JupyterLab writes random ones into a learner's copy on save). Read as JSON first: nbformat's
reader quietly fills in missing ids."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_has_an_id_and_the_notebook_validates(path: Path) -> None:
    raw = json.loads(path.read_text())
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5), f"{path.name}: nbformat 4.5"
    ids = [cell.get("id") for cell in raw["cells"]]
    assert None not in ids, f"{path.name}: cell {ids.index(None)} has no id"
    assert len(set(ids)) == len(ids), f"{path.name}: duplicate cell ids"
    nbformat.validate(nbformat.reads(path.read_text(), as_version=nbformat.NO_CONVERT))
