"""``spectra sharpness --x steps|epochs`` (and ``spectra plot --x``): each checkpoint at its
training step (``--steps``, the optimizer's iteration counter saved in the checkpoint, or
the file names) or epoch (the file names, or steps / ``--steps-per-epoch``), the axis
label naming the source, both axes recorded in sharpness.json; one-line errors when the
unit cannot be known; the optimizer named when its threshold is not drawn."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt

import spectra
from spectra.analysis.trajectory import plan_checkpoints
from spectra.cli import main
from spectra.cli._common import UserError
from spectra.io.checkpoints import find_checkpoints, stored_iterations
from spectra.reports.base import InputError
from spectra.reports.sharpness_axes import x_axes

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
DIGITS = str(DATA / "digits.npz")
LOSS = "sparse_categorical_crossentropy"
# 64 examples in batches of 16: 4 optimizer steps per epoch.
STEPS_PER_EPOCH = 4


@pytest.fixture(scope="module")
def adam_epochs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two epoch-named .keras checkpoints of a compiled MLP trained with Adam: the
    optimizer's iteration counter is 4 after epoch 1 and 8 after epoch 2."""
    import keras

    run = tmp_path_factory.mktemp("adam") / "run"
    run.mkdir()
    digits = np.load(DIGITS)
    x, y = digits["x"][:64], digits["y"][:64]
    model = keras.models.load_model(DATA / "gd_trajectory" / "step_0000.keras", compile=False)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    for epoch in (1, 2):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.save(run / f"epoch_{epoch:03d}.keras")
    return run


def _copies(tmp_path: Path, names: list[str], source: str = "step_0000.keras") -> Path:
    """Uncompiled checkpoints (no optimizer state) under other names."""
    run = tmp_path / "named"
    run.mkdir()
    for name in names:
        shutil.copyfile(DATA / "gd_trajectory" / source, run / name)
    return run


def _axes(directory: Path, *, x: str | None, per_epoch: int | None = None, steps=None):
    plan = plan_checkpoints(find_checkpoints(directory, steps=steps))
    return x_axes(plan, x_axis=x, steps_per_epoch=per_epoch, steps=steps)


def _figure(path: Path, x: str | None = None):
    from spectra.cli.plot import _drawing, _read

    options = argparse.Namespace(style="column", no_title=False, caption="full", x_axis=x)
    draw, _ = _drawing(path, _read(path), options)
    ((_, _, figure),) = draw()
    return figure


def test_stored_iterations_reads_the_optimizer_counter(adam_epochs, tmp_path):
    assert stored_iterations(adam_epochs / "epoch_001.keras") == STEPS_PER_EPOCH
    assert stored_iterations(adam_epochs / "epoch_002.keras") == 2 * STEPS_PER_EPOCH
    # An uncompiled model, a file that is not a checkpoint: no counter.
    assert stored_iterations(DATA / "gd_trajectory" / "step_0020.keras") is None
    (tmp_path / "junk.keras").write_bytes(b"not a zip")
    assert stored_iterations(tmp_path / "junk.keras") is None


def test_weights_file_counter(adam_epochs, tmp_path):
    import keras

    model = keras.models.load_model(adam_epochs / "epoch_002.keras")
    model.save_weights(tmp_path / "w.weights.h5")
    assert stored_iterations(tmp_path / "w.weights.h5") == 2 * STEPS_PER_EPOCH


@pytest.mark.slow  # a sharpness run through TensorFlow (about 6 s)
def test_steps_from_the_optimizer_and_epochs_from_steps_per_epoch(adam_epochs, tmp_path, capsys):
    out = tmp_path / "out"
    status = main(
        [
            "sharpness",
            str(adam_epochs),
            "--data",
            DIGITS,
            "--loss",
            LOSS,
            "--max-examples",
            "60",
            "--no-progress",
            "--out",
            str(out),
            "--x",
            "steps",
            "--steps-per-epoch",
            str(STEPS_PER_EPOCH),
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    path = out / "sharpness.json"
    report = json.loads(path.read_text())
    assert report["x_axis"] == "steps"
    steps, epochs = report["x_axes"]["steps"], report["x_axes"]["epochs"]
    assert steps["source"] == "optimizer iterations"
    assert steps["values"] == {"epoch_001.keras": 4, "epoch_002.keras": 8}
    assert steps["label"] == "Training step (optimizer iterations)"
    assert epochs["values"] == {"epoch_001.keras": 1.0, "epoch_002.keras": 2.0}
    assert epochs["label"] == "Epoch (optimizer iterations / 4)"
    # The recorded entries keep the file names' numbers (resume matches on them).
    assert [entry["step"] for entry in report["checkpoints"]] == [1, 2]
    # Adam's threshold bounds λ_max(P⁻¹H): dropped, named in the warning and the record.
    assert "no threshold: Adam's threshold (2+2β₁)/((1−β₁)η) bounds" in captured.err
    assert report["threshold"] is None and report["dropped_threshold"]["optimizer"] == "Adam"
    assert isinstance(spectra.load(path), spectra.reports.SharpnessReport)

    # Redrawn from the JSON: the run's axis, then the other one with spectra plot --x.
    figure = _figure(path)
    ax = figure.axes[0]
    assert ax.get_xlabel() == "Training step (optimizer iterations)"
    assert list(ax.get_lines()[0].get_xdata()) == [4, 8]
    texts = [text.get_text().replace("\n", " ") for text in figure.legends[0].get_texts()]
    assert "no threshold: Adam's is for λ₁(P⁻¹H), not λ₁(H)" in texts, texts
    plt.close(figure)
    figure = _figure(path, "epochs")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "Epoch (optimizer iterations / 4)"
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 2.0]
    plt.close(figure)
    assert main(["plot", str(path), "--x", "epochs", "--quiet"]) == 0
    assert (out / "replot" / "sharpness.png").is_file()


def test_default_and_epochs_from_the_file_names(adam_epochs):
    from spectra.reports.sharpness_axes import x_positions

    axes = _axes(adam_epochs, x="epochs")
    assert axes["epochs"]["label"] == "Epoch (from the file names)"
    assert axes["epochs"]["values"] == {"epoch_001.keras": 1, "epoch_002.keras": 2}
    assert axes["steps"]["source"] == "optimizer iterations"
    done = [{"file": "epoch_001.keras", "step": 1}, {"file": "epoch_002.keras", "step": 2}]
    report = {"x_axes": axes}
    # Without --x: the names' own numbers, labelled with what they count.
    assert x_positions(report, done, None, "epoch", "file names") == (
        [1, 2],
        "Epoch (from the file names)",
    )
    assert x_positions(report, done, "steps", "epoch", "file names") == (
        [4, 8],
        "Training step (optimizer iterations)",
    )


def test_steps_from_the_file_names_and_from_steps(tmp_path):
    run = _copies(tmp_path, ["step_0000.keras", "step_0020.keras"])
    axes = _axes(run, x="steps")
    assert axes["steps"] == {
        "source": "file names",
        "label": "Training step (from the file names)",
        "values": {"step_0000.keras": 0, "step_0020.keras": 20},
    }
    assert "epochs" not in axes
    axes = _axes(run, x="epochs", per_epoch=10, steps=[0, 50])
    assert axes["steps"]["label"] == "Training step (from --steps)"
    assert axes["epochs"]["label"] == "Epoch (--steps / 10)"
    assert axes["epochs"]["values"] == {"step_0000.keras": 0.0, "step_0020.keras": 5.0}
    axes = _axes(run, x="epochs", per_epoch=10)
    assert axes["epochs"]["label"] == "Epoch (steps in the file names / 10)"
    assert axes["epochs"]["source"] == "file names / 10"
    assert axes["epochs"]["values"] == {"step_0000.keras": 0.0, "step_0020.keras": 2.0}


@pytest.mark.parametrize(
    ("names", "x", "per_epoch", "message"),
    [
        (
            ["epoch_001.keras", "epoch_002.keras"],
            "steps",
            None,
            "--x steps: the checkpoints' training steps are not known: the file names count "
            "epochs, not steps (epoch_001.keras, …) and no checkpoint holds an optimizer "
            "iteration counter (a .keras or .weights.h5 saved from a compiled model after "
            "training does); pass --steps STEP [STEP ...] (one per checkpoint file, in "
            "natural name order).",
        ),
        (
            ["step_0000.keras", "step_0020.keras"],
            "epochs",
            None,
            "--x epochs: the checkpoints' epochs are not known (the file names count steps, "
            "not epochs): pass --steps-per-epoch N (the optimizer steps in one epoch) to "
            "plot training step / N.",
        ),
        (
            ["ckpt-1.keras", "ckpt-2.keras"],
            "epochs",
            5,
            "--x epochs: --steps-per-epoch 5 divides the training steps, which are not known: "
            "the file names count checkpoints, not steps (ckpt-1.keras, …) and no checkpoint "
            "holds an optimizer iteration counter",
        ),
        (
            ["step_0000.keras", "step_0020.keras"],
            None,
            5,
            "--steps-per-epoch 5 places the checkpoints at training step / 5 on an epoch "
            "axis: add --x epochs (or leave it out).",
        ),
    ],
)
def test_unknown_units_are_refused(names, x, per_epoch, message, tmp_path):
    run = _copies(tmp_path, names)
    with pytest.raises(InputError) as caught:
        _axes(run, x=x, per_epoch=per_epoch)
    assert str(caught.value).startswith(message), str(caught.value)


def test_some_checkpoints_without_a_counter(adam_epochs, tmp_path):
    run = tmp_path / "mixed"
    run.mkdir()
    shutil.copyfile(adam_epochs / "epoch_001.keras", run / "epoch_001.keras")
    shutil.copyfile(DATA / "gd_trajectory" / "step_0000.keras", run / "epoch_002.keras")
    with pytest.raises(InputError, match=r"1 of 2 checkpoints hold no optimizer iteration "):
        _axes(run, x="steps")
    # Two saves with the same counter are not training steps.
    shutil.copyfile(adam_epochs / "epoch_001.keras", run / "epoch_002.keras")
    with pytest.raises(InputError, match=r"counters repeat \(\[4, 4\]"):
        _axes(run, x="steps")


def test_cli_error_is_one_line_with_status_2(tmp_path, capsys):
    run = _copies(tmp_path, ["epoch_001.keras", "epoch_002.keras"])
    args = [
        "sharpness", str(run), "--data", DIGITS, "--loss", LOSS, "--max-examples", "60",
        "--no-progress", "--out", str(tmp_path / "out"), "--x", "steps",
    ]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("spectra: error: --x steps: the checkpoints' training steps are not")
    assert err.count("\n") == 1


def test_plot_refuses_an_axis_the_run_did_not_record(tmp_path, capsys):
    record = {
        "type": "SharpnessReport",
        "command": f"spectra sharpness run --data {DIGITS} --out o",
        "step_unit": "step",
        "step_source": "file names",
        "checkpoints": [
            {"status": "done", "file": "step_0000.keras", "step": 0},
        ],
        "x_axes": {"steps": {"source": "file names", "label": "x", "values": {}}},
    }
    path = tmp_path / "sharpness.json"
    path.write_text(json.dumps(record))
    from spectra.cli.plot import _drawing

    options = argparse.Namespace(style=None, no_title=False, caption="short", x_axis="epochs")
    with pytest.raises(UserError, match=r"--x epochs: the run records no epochs for its "):
        _drawing(path, record, options)
