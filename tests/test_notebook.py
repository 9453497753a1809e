"""notebooks/energy_playground.ipynb runs top to bottom on CPU and its numbers hold (issue #7).

The notebook runs in a Jupyter kernel of *this* interpreter (a kernelspec written into tmp_path,
found first through JUPYTER_PATH), so it sees the cem_jax installed in this environment and
nothing else; nothing outside tmp_path is written. Matplotlib uses the inline backend: headless
like Agg, but figures come back as image/png outputs that the test can count (with
MPLBACKEND=Agg, plt.show() in a kernel displays nothing).
"""

import json
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "energy_playground.ipynb"
KERNEL = "cem_jax_test_python"
NUMBER = r"(-?[0-9.]+(?:e[+-]?[0-9]+)?)"


def write_kernelspec(root: Path) -> None:
    """A kernelspec for sys.executable under root/kernels/KERNEL."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "cem_jax test kernel",
        "language": "python",
        "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "JAX_PLATFORMS": "cpu"},
    }))


def stream_text(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.output_type == "stream")


def test_committed_notebook_is_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "REPO_URL" in code[0].source and "import cem_jax" in code[0].source


def test_energy_playground_runs(tmp_path, monkeypatch):
    write_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # Connection files and IPython's profile in tmp_path: no writes to (or startup files from) HOME.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name=KERNEL, timeout=300,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = stream_text(nb)

    # a. and d.: -jax.grad(energy) equals the closed forms (hand-written and the package's).
    diffs = [float(d) for d in re.findall(r"max \|autodiff - [^|]+\| = " + NUMBER, text)]
    assert len(diffs) == 5, text
    assert max(diffs) < 1e-5, diffs
    mine, package = map(float, re.search(
        rf"attention energy: mine {NUMBER}, package {NUMBER}", text).groups())
    assert abs(mine - package) <= 1e-4 * abs(package)

    # b. and d.: the energy falls over recursive steps.
    for name in ("run_steps energy", "new energy"):
        first, last = map(float, re.search(rf"{name}: {NUMBER} -> {NUMBER}", text).groups())
        assert last < first, (name, first, last)

    # c.: the tiny model learns the synthetic task.
    first, last = map(float, re.search(rf"loss: {NUMBER} -> {NUMBER}", text).groups())
    assert last < 0.5 * first, (first, last)
    assert "falls at every step: True" in text

    images = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 3
