"""Saving figures (spectra.plotting.saving): atomic writes, directories, formats, overwrite,
bad targets."""

import os

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from spectra.plotting import (
    plot_eigenvalues,
    plot_spectral_density,
    save_figure,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_save_figure_png_atomic_and_creates_directories(tmp_path, density):
    ax = plot_spectral_density(density)
    target = tmp_path / "nested" / "deeper" / "density.png"
    returned = save_figure(ax, target)
    assert returned == target
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1000
    assert os.listdir(target.parent) == ["density.png"]
    assert plt.fignum_exists(ax.figure.number)  # the caller still owns the figure


def test_save_figure_from_figure_pdf_and_overwrite(tmp_path, eigen):
    figure = plot_eigenvalues(eigen).figure
    target = tmp_path / "eigen.pdf"
    target.write_bytes(b"old")
    save_figure(figure, str(target))
    assert target.read_bytes().startswith(b"%PDF")
    assert os.listdir(tmp_path) == ["eigen.pdf"]


def test_save_figure_failure_keeps_old_file_and_no_temp(tmp_path, monkeypatch, eigen):
    figure = plot_eigenvalues(eigen).figure
    target = tmp_path / "eigen.png"
    target.write_bytes(b"previous")

    def broken_savefig(name, **kwargs):
        with open(name, "wb") as stream:
            stream.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        save_figure(figure, target)
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["eigen.png"]


def test_save_figure_rejects_bad_targets(tmp_path, eigen):
    ax = plot_eigenvalues(eigen)
    with pytest.raises(ValueError, match="suffix"):
        save_figure(ax, tmp_path / "figure")
    with pytest.raises(ValueError, match="unsupported figure format"):
        save_figure(ax, tmp_path / "figure.docx")
    with pytest.raises(TypeError, match="Figure or Axes"):
        save_figure("not a figure", tmp_path / "figure.png")
    assert os.listdir(tmp_path) == []
