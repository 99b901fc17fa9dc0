"""Figures for print: fonts embedded as TrueType in PDF and kept as text in SVG, the
'column' and 'page' presets (size, fonts >= 7 pt, nothing outside the canvas, legends
inside), optional title and caption with the settings in the file's metadata, the
single-eigenvalue plot, digits from the uncertainty, and the threshold drawn only for the
matrix it bounds."""

import re
import warnings

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from _figure_helpers import SHARPNESS, STEPS
from matplotlib.text import Text

from spectra.analysis.per_layer import layerwise
from spectra.analysis.repeats import repeat_estimate
from spectra.estimators.density import spectral_density
from spectra.estimators.eigensolvers import eigenvalues
from spectra.plotting import (
    STYLES,
    add_title,
    figure_style,
    format_value,
    new_figure,
    plot_eigenvalues,
    plot_layerwise,
    plot_loss_landscape_1d,
    plot_loss_landscape_2d,
    plot_sharpness,
    plot_spectral_density,
    save_figure,
    value_digits,
)
from spectra.plotting.captions import caption_artist as _caption_text

# A glyph the fonts lack draws as a box or a bar at print size: every test here draws its
# figure, so a missing glyph fails the test.
pytestmark = pytest.mark.filterwarnings("error:Glyph .* missing from font:UserWarning")


@pytest.fixture(autouse=True)
def _every_glyph_drawn(caplog):
    """Mathtext logs a glyph its font lacks ("substituting with a dummy symbol") instead of
    warning: a box at print size too."""
    yield
    drawn = caplog.get_records("setup") + caplog.get_records("call")
    missing = [record.getMessage() for record in drawn if "glyph" in record.getMessage()]
    assert not missing, missing


LOSSES = np.linspace(2.3, 0.4, STEPS.size)
CAPTION = "mlp, 3,466 parameters · digits, 1,797 examples · Hessian · Lanczos, k = 5, seed 0"


@pytest.fixture(scope="module")
def matrix() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.diag(np.concatenate([[12.0, 7.0, 4.0, 3.5, 3.1], rng.normal(0.05, 0.05, 95)]))


@pytest.fixture(scope="module")
def results(matrix):
    """One result of each kind, computed once: top 5 and top 1 eigenvalues, a density and a
    per-layer result with traces."""
    rng = np.random.default_rng(1)
    blocks = np.zeros((24, 24))
    groups = {}
    for index, name in enumerate(["dense/kernel", "dense/bias", "output/kernel", "output/bias"]):
        q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
        blocks[6 * index : 6 * index + 6, 6 * index : 6 * index + 6] = (
            q @ np.diag(np.linspace(-1.0, 3.0, 6) * (index + 1)) @ q.T
        )
        groups[name] = list(range(6 * index, 6 * index + 6))
    # Repeats over subsets of the rows of a feature matrix X (matrix XᵀX/m of each subset).
    features = rng.standard_normal((200, 12)) * np.linspace(3.0, 0.3, 12)

    def estimate(operator, seed):
        return {"eigenvalues": eigenvalues(operator, k=5, seed=seed)}

    repeats = repeat_estimate(
        estimate,
        data=(features,),
        build=lambda arrays: arrays[0].T @ arrays[0] / len(arrays[0]),
        subsample=0.5,
        repeats=5,
        seed=0,
    )
    top10 = [6.3, 3.37, 2.62, 1.68, 1.41, 1.19, 1.04, 0.91, 0.77, 0.565]
    log10 = np.diag(np.r_[top10, np.zeros(20)])
    return {
        "log10": eigenvalues(log10, k=10),
        "gram": eigenvalues(features.T @ features / 200, k=5),
        "repeats": repeats,
        "top5": eigenvalues(matrix, k=5),
        "top1": eigenvalues(matrix, k=1),
        "density": spectral_density(
            matrix, num_steps=20, num_probes=4, seed=0, distribution="gaussian"
        ),
        "layers": layerwise(blocks, k=2, trace=True, groups=groups, num_probes=10, seed=0),
    }


def _draw(kind: str, results, style: str, **options):
    """The figure of ``kind`` in ``style``; ``options`` (``font``, ``legend``) go to the
    plotting function."""
    if kind == "eigenvalues":
        return plot_eigenvalues(results["top5"], style=style, **options)
    if kind == "eigenvalue":
        return plot_eigenvalues(results["top1"], style=style, **options)
    if kind == "eigenvalues_repeats":
        return plot_eigenvalues(results["gram"], repeats=results["repeats"], style=style, **options)
    if kind == "density":
        return plot_spectral_density(results["density"], style=style, **options)
    if kind == "layers":
        return plot_layerwise(results["layers"], style=style, **options)
    if kind == "sharpness":
        return plot_sharpness(
            STEPS,
            SHARPNESS,
            lr=0.2,
            errors=SHARPNESS * 1e-3,
            losses=LOSSES,
            style=style,
            **options,
        )
    if kind == "sharpness_full":
        # The reviewer's `sharpness --top-k 3 --trace --plot-overlap` and the long label of
        # the preconditioned sharpness.
        values = np.stack([SHARPNESS, 0.8 * SHARPNESS, 0.6 * SHARPNESS], axis=1)
        return plot_sharpness(
            STEPS,
            values,
            lr=0.2,
            errors=values * 1e-6,
            traces=8 * SHARPNESS,
            trace_errors=0.4 * SHARPNESS,
            losses=LOSSES,
            overlaps=np.r_[np.nan, np.linspace(0.3, 0.99, STEPS.size - 1)],
            ylabel="Preconditioned sharpness λ₁(P⁻¹H)",
            xlabel="Training step (from the file names)",
            style=style,
            **options,
        )
    if kind == "eigenvalues_log":
        return plot_eigenvalues(results["log10"], log_scale=True, style=style, **options)
    if kind == "landscape_1d":
        alphas = np.linspace(-1, 1, 21)
        return plot_loss_landscape_1d(
            alphas,
            {"v₁": 1 + 3 * alphas**2, "random direction": 1 + alphas**2},
            xlabel="Distance α in parameter space",
            style=style,
            **options,
        )
    alphas = np.linspace(-1, 1, 9)
    surface = 1 + alphas[:, None] ** 2 + 2 * alphas[None, :] ** 2
    options.pop("legend", None)  # a colorbar, no legend
    return plot_loss_landscape_2d(alphas, alphas, surface, style=style, **options)


KINDS = [
    "eigenvalues",
    "eigenvalue",
    "eigenvalues_log",
    "sharpness_full",
    "eigenvalues_repeats",
    "density",
    "layers",
    "sharpness",
    "landscape_1d",
    "2d",
]


def _texts(figure) -> list[Text]:
    shown = [text for text in figure.findobj(Text) if text.get_visible() and text.get_text()]
    return [text for text in shown if text.get_text().strip()]


@pytest.mark.parametrize("style", ["column", "page"])
@pytest.mark.parametrize("titled", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_every_plot_fits_its_print_size(kind, style, titled, results):
    """At the preset's width: every text at least 7 pt and inside the canvas, every legend
    inside its axes (or the figure, for the legend under the axes); the user's rcParams
    untouched."""
    before = dict(matplotlib.rcParams)
    ax = _draw(kind, results, style)
    _assert_fits_print(ax, kind, style, titled)
    assert dict(matplotlib.rcParams) == before
    plt.close(ax.figure)


def _assert_fits_print(ax, kind: str, style: str, titled: bool) -> list[Text]:
    """What every print figure keeps (see :func:`test_every_plot_fits_its_print_size`),
    after an optional title and caption; returns the texts drawn."""
    figure = ax.figure
    assert figure.get_figwidth() == pytest.approx(STYLES[style].width)
    if titled:
        add_title(ax, "Top eigenvalues of the Hessian", CAPTION)
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    canvas = figure.bbox
    texts = _texts(figure)
    assert texts
    for text in texts:
        assert text.get_fontsize() >= 7.0 - 1e-9, (text.get_text(), text.get_fontsize())
    # What is drawn (tick labels out of view are not), in inches.
    drawn = figure.get_tightbbox(renderer)
    size = figure.get_size_inches()
    # (half a point of slack: the spines' own width)
    assert drawn.x0 >= -0.02 and drawn.y0 >= -0.02, drawn
    assert drawn.x1 <= size[0] + 0.02 and drawn.y1 <= size[1] + 0.02, (drawn, size)
    # Every label's text inside the canvas, wherever its axes sit (a y label taller than
    # its axes would run past the top and bottom); tick labels: in the drawn box above.
    ticks = {
        id(label)
        for axes in figure.axes
        for axis in (axes.xaxis, axes.yaxis)
        for minor in (False, True)
        for label in axis.get_ticklabels(minor=minor)
    }
    for text in texts:
        if id(text) in ticks:
            continue
        box = text.get_window_extent(renderer)
        assert canvas.x0 - 2 <= box.x0 and box.x1 <= canvas.x1 + 2, text.get_text()
        assert canvas.y0 - 2 <= box.y0 and box.y1 <= canvas.y1 + 2, text.get_text()
    # At most two y axes per panel (axes at the same place: a panel and its twin).
    places: dict[tuple[float, ...], int] = {}
    for axes in figure.axes:
        if axes.get_label() != "<colorbar>":
            key = tuple(round(value, 3) for value in axes.get_position().bounds)
            places[key] = places.get(key, 0) + 1
    assert max(places.values()) <= 2, places
    # No unicode subscript letters the fonts draw as bars at this size (mathtext instead).
    assert not [text.get_text() for text in texts if "ₗ" in text.get_text()]
    # Title and caption centred on the same vertical line.
    if titled:
        title = figure._suptitle.get_window_extent(renderer)
        caption = ax.title.get_window_extent(renderer)
        assert abs((title.x0 + title.x1) / 2 - (caption.x0 + caption.x1) / 2) < 2.0
    # Value labels written beside markers stay inside the axes (off the spines).
    if kind.startswith("eigenvalue"):
        frame = ax.get_window_extent(renderer)
        for label in ax.texts:
            box = label.get_window_extent(renderer)
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1, label.get_text()
    # A legend in the axes stays in them; one under the axes (the per-layer bars) is no
    # wider than them; a figure legend stays on the canvas.
    for axes in figure.axes:
        legend = axes.get_legend()
        if legend is not None:
            box, frame = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
            assert frame.x0 - 2 <= box.x0 and box.x1 <= frame.x1 + 2
            if box.y1 > frame.y0:
                assert frame.y0 - 2 <= box.y0 and box.y1 <= frame.y1 + 2
            assert box.y0 >= canvas.y0 - 2
    for legend in figure.legends:
        box = legend.get_window_extent(renderer)
        assert canvas.x0 - 2 <= box.x0 and box.x1 <= canvas.x1 + 2
        assert canvas.y0 - 2 <= box.y0 and box.y1 <= canvas.y1 + 2
    return texts


@pytest.mark.parametrize("style", ["column", "page"])
def test_sharpness_trace_and_overlap_in_a_panel_below(style):
    """Trace and overlap go into a second panel sharing x, under the sharpness and loss: two
    y axes per panel, the figure taller than the preset, the legend a fifth of it at most."""
    ax = _draw("sharpness_full", None, style)
    figure = ax.figure
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    labels = {axes.get_ylabel(): axes for axes in figure.axes}
    assert set(labels) == {
        "Preconditioned sharpness λ₁(P⁻¹H)",
        "Loss",
        "Trace of H",
        "Overlap",
    }
    upper, lower = ax.get_position(), labels["Trace of H"].get_position()
    assert labels["Loss"].get_position().bounds == upper.bounds
    assert labels["Overlap"].get_position().bounds == lower.bounds
    assert lower.y1 <= upper.y0 and lower.x0 == pytest.approx(upper.x0)
    assert labels["Trace of H"].get_shared_x_axes().joined(ax, labels["Trace of H"])
    # One x label, under the lower panel.
    assert labels["Trace of H"].get_xlabel() and not ax.xaxis.label.get_visible()
    assert figure.get_figheight() > STYLES[style].width * STYLES[style].aspect * 1.5
    (legend,) = figure.legends
    assert legend.get_window_extent(renderer).height < 0.3 * figure.bbox.height
    # The threshold is called one, not a bound.
    texts = [text.get_text() for text in legend.get_texts()]
    assert any("stability threshold" in text for text in texts), texts
    assert not any("bounds λ" in text for text in texts), texts
    plt.close(figure)


def test_two_dimensional_landscape_has_equal_scales():
    """α and β span the same range: the axes box is square (1 unit of α as long as 1 of β),
    on a page as on a column."""
    for style in ("column", "page"):
        ax = _draw("2d", None, style)
        ax.figure.draw_without_rendering()
        box = ax.get_window_extent(ax.figure.canvas.get_renderer())
        assert ax.get_aspect() == 1.0
        assert box.width == pytest.approx(box.height, rel=0.02), (style, box)
        assert box.height > 0.5 * ax.figure.bbox.height
        plt.close(ax.figure)


def test_log_eigenvalue_axis_has_decimal_ticks(results):
    """λ from 0.565 to 6.3 (about one decade) on a log axis: ticks 0.6, 1, 2, 3, 4, 6 as
    plain decimals, no "6 × 10⁰"; the value labels inside the axes."""
    ax = plot_eigenvalues(results["log10"], log_scale=True, style="column")
    figure = ax.figure
    figure.draw_without_rendering()
    low, high = ax.get_ylim()
    shown = [
        label.get_text()
        for label, tick in zip(ax.get_yticklabels(), ax.get_yticks())
        if low <= tick <= high and label.get_text()
    ]
    assert shown == ["0.6", "1", "2", "3", "4", "6"]
    assert not [label for label in ax.get_yticklabels(minor=True) if label.get_text()]
    renderer = figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    assert len(ax.texts) == 10
    assert max(label.get_window_extent(renderer).x1 for label in ax.texts) < frame.x1
    plt.close(figure)
    # Over more than two decades matplotlib's decades stay.
    wide = eigenvalues(np.diag([500.0, 20.0, 1.0, 0.0]), k=3)
    ax = plot_eigenvalues(wide, log_scale=True, style="column")
    ax.figure.draw_without_rendering()
    assert "10" in " ".join(label.get_text() for label in ax.get_yticklabels())
    plt.close(ax.figure)


def test_single_eigenvalue_is_centred_with_a_one_line_legend(results):
    for style in ("column", "page"):
        ax = plot_eigenvalues(results["top1"], style=style)
        left, right = ax.get_xlim()
        assert (1.0 - left) == pytest.approx(right - 1.0)
        if style == "page":
            (legend,) = ax.figure.legends
            assert "\n" not in legend.get_texts()[0].get_text()
        plt.close(ax.figure)


def test_title_and_caption_of_side_by_side_panels_centred_on_the_figure(results):
    figure, (left, right) = new_figure("page", ncols=2)
    plot_layerwise(results["layers"], ax=left, style="page")
    plot_layerwise(results["layers"], quantity="trace", ax=right, style="page")
    add_title(figure, "Per-layer spectra", CAPTION)
    figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    middle = figure.bbox.width / 2
    for text in (figure._suptitle, _caption_text(figure)):
        box = text.get_window_extent(renderer)
        assert abs((box.x0 + box.x1) / 2 - middle) < 4.0, text.get_text()  # 0.04 in
    plt.close(figure)


def test_caption_text_for_print():
    from spectra.plotting import print_text

    text = print_text(
        "Lanczos, k = 5, tol = 1e-08 · 10 probes × 80 steps · 26.3 ± 1.3 (mean ± sd) · 3.8e+04"
    )
    nbsp = "\u00a0"
    assert f"tol{nbsp}={nbsp}1e-8" in text
    assert f"10{nbsp}probes{nbsp}×{nbsp}80{nbsp}steps" in text
    assert f"mean{nbsp}±{nbsp}sd" in text and "3.8e4" in text
    ax = plot_eigenvalues(eigenvalues(np.diag([3.0, 2.0, 1.0]), k=2), style="column")
    add_title(ax, "Top 2", "a, b · Lanczos, k = 2, tol = 1e-08 · 10 probes × 80 steps")
    caption = ax.title.get_text()
    assert "1e-08" not in caption and "1e-8" in caption
    assert f"probes{nbsp}×" in caption
    plt.close(ax.figure)


def test_a_given_axes_keeps_its_size(results):
    figure, ax = plt.subplots(figsize=(5.0, 4.0))
    plot_eigenvalues(results["top5"], ax=ax, style="column")
    assert tuple(figure.get_size_inches()) == (5.0, 4.0)
    plt.close(figure)


def test_unknown_style_is_refused(results):
    with pytest.raises(ValueError, match="style must be one of 'column', 'page'"):
        plot_eigenvalues(results["top5"], style="poster")
    with pytest.raises(TypeError, match="style must be a str"):
        plot_eigenvalues(results["top5"], style=3)


def test_single_eigenvalue_plot(results):
    """k = 1: one integer tick at 1, no offset text, an axis not collapsed to the error bar
    (which the legend says is smaller than the marker), the value from its bound."""
    result = results["top1"]
    ax = plot_eigenvalues(result, style="column")
    ax.figure.draw_without_rendering()
    ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
    assert ticks == [1.0]
    assert ax.yaxis.get_offset_text().get_text() == ""
    low, high = ax.get_ylim()
    assert high - low >= 0.1 * 12.0 - 1e-12
    legend_texts = [text.get_text() for legend in ax.figure.legends for text in legend.texts]
    assert any("smaller than the markers" in text for text in legend_texts)
    labels = [text.get_text() for text in ax.texts]
    bound = float(result.error_bounds[0])
    assert labels == [format_value(12.0, bound)]
    plt.close(ax.figure)


@pytest.mark.parametrize("style", [None, "column"])
def test_repeats_spread_beside_the_numerical_bound(results, style):
    """With repeats: per eigenvalue the repeats' values (dots) and mean ± sd (diamonds with
    bars equal to the sample sd) left of the run's marker, whose bars stay; the legend
    names both uncertainties."""
    repeats = results["repeats"]
    ax = plot_eigenvalues(results["gram"], repeats=repeats, style=style)
    figure = ax.figure
    legend = figure.legends[0] if figure.legends else ax.get_legend()
    texts = [text.get_text().replace("\n", " ") for text in legend.get_texts()]
    # One parenthesised group at most per entry; the repeats named by their subsets' size
    # (100 of the 200 rows), not called an error bar.
    assert texts[0].startswith("λᵢ ± numerical bound of this run")
    assert texts[1:] == [
        "λᵢ of each subset of 100 examples",
        "λᵢ of 5 subsets of 100 examples (mean\u00a0±\u00a0sd)",
    ]
    assert all(text.count("(") <= 1 for text in texts), texts
    dots = [line for line in ax.get_lines() if line.get_marker() == "o" and line.get_alpha()]
    (dots,) = dots
    assert np.array_equal(np.sort(dots.get_ydata()), np.sort(repeats.values[:, :5].ravel()))
    (diamonds,) = [line for line in ax.get_lines() if line.get_marker() == "D"]
    np.testing.assert_allclose(diamonds.get_xdata(), np.arange(1, 6) - 0.3)
    np.testing.assert_allclose(diamonds.get_ydata(), repeats.mean[:5], rtol=1e-12)
    # The bars of the diamonds span mean ± sd, with sd the sample standard deviation.
    sd = np.std(repeats.values[:, :5], axis=0, ddof=1)
    spans = [
        collection.get_segments()
        for collection in ax.collections
        if len(collection.get_segments()) == 5
        and np.allclose([seg[0][0] for seg in collection.get_segments()], np.arange(1, 6) - 0.3)
    ]
    (segments,) = spans
    heights = np.array([seg[1][1] - seg[0][1] for seg in segments])
    np.testing.assert_allclose(heights, 2 * sd, rtol=1e-9)
    assert sd.min() > 0.05  # a real spread, which the test would see go missing
    # No value labels by default: they would run into the next index's spread.
    assert not ax.texts
    plt.close(figure)
    # One eigenvalue: the spread of λ1 only.
    ax = plot_eigenvalues(results["top1"], repeats=repeats, style=style)
    (diamonds,) = [line for line in ax.get_lines() if line.get_marker() == "D"]
    np.testing.assert_allclose(diamonds.get_ydata(), repeats.mean[:1], rtol=1e-12)
    plt.close(ax.figure)


def test_repeats_without_eigenvalues_are_refused(results):
    from spectra.analysis.repeats import repeat_estimate as rerun

    traces = rerun(lambda op, seed: {"trace": float(np.trace(op))}, np.eye(3), repeats=2)
    with pytest.raises(ValueError, match="repeats hold no eigenvalue"):
        plot_eigenvalues(results["gram"], repeats=traces)
    with pytest.raises(TypeError, match="repeats must be a RepeatResult or None"):
        plot_eigenvalues(results["gram"], repeats={"λ1": [1.0]})
    plt.close("all")


def test_digits_follow_the_uncertainty():
    # 2 significant digits of the error fix the value's last digit: the same for both.
    assert format_value(17.634, 0.41) == "17.63"
    assert format_value(17.77, 0.41) == "17.77"
    assert format_value(17.6, 4.1) == "17.6"
    assert format_value(22.215331, 2.1e-3) == "22.2153"
    assert format_value(22.215331, 2.1e-6) == "22.2153"  # at most 6 digits on a figure
    assert format_value(3.14159, None) == "3.14159"
    assert value_digits(17.634, 0.41) == 4 and value_digits(0.0, 0.1) is None
    assert value_digits(17.634, float("nan")) is None


def test_threshold_note_replaces_the_line():
    ax = plot_sharpness(
        STEPS, SHARPNESS, losses=LOSSES, threshold_note="no Adam threshold: it does not bound H"
    )
    assert not [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    texts = [text.get_text() for legend in ax.figure.legends for text in legend.get_texts()]
    assert "no Adam threshold: it does not bound H" in texts
    plt.close(ax.figure)


def test_loss_clear_of_the_threshold_line():
    """The loss curve starts at the top of its range: it must stay below the threshold
    line's height (in axes fractions) rather than on it."""
    ax = plot_sharpness(STEPS, SHARPNESS, lr=0.2, losses=LOSSES, style="column")
    (loss_ax,) = [other for other in ax.figure.axes if other is not ax]
    low, high = ax.get_ylim()
    at = (10.0 - low) / (high - low)
    loss_low, loss_high = loss_ax.get_ylim()
    highest = (LOSSES.max() - loss_low) / (loss_high - loss_low)
    assert highest <= at - 0.05
    plt.close(ax.figure)


@pytest.fixture(scope="module")
def saved(results, tmp_path_factory):
    """One styled figure with a title and caption, saved as PDF, SVG, PNG and EPS."""
    directory = tmp_path_factory.mktemp("saved")
    ax = plot_eigenvalues(results["top5"], style="column")
    add_title(ax, None, None, metadata="Hessian · Lanczos, k = 5 · seed 7 · trace 41.0 ± 1.2")
    paths = {
        fmt: save_figure(ax, directory / f"eigenvalues.{fmt}")
        for fmt in ("pdf", "svg", "png", "eps")
    }
    plt.close(ax.figure)
    return paths


def test_pdf_embeds_truetype_fonts_and_metadata(saved):
    data = saved["pdf"].read_bytes()
    assert b"/Type3" not in data and b"/Subtype /Type3" not in data
    assert b"/FontFile2" in data
    assert b"/Subtype /TrueType" in data or b"/CIDFontType2" in data
    info = re.search(rb"/Subject (<[0-9A-Fa-f]+>|\((?:[^)\\]|\\.)*\))", data)
    assert info is not None
    raw = info.group(1)
    if raw.startswith(b"<"):
        encoded = bytes.fromhex(raw[1:-1].decode())
    else:
        encoded = re.sub(rb"\\(.)", rb"\1", raw[1:-1])
    subject = encoded.decode("utf-16" if encoded.startswith(b"\xfe\xff") else "latin-1")
    assert "seed 7" in subject and "trace 41.0 ± 1.2" in subject


def test_svg_keeps_text_and_metadata(saved):
    text = saved["svg"].read_text()
    assert re.search(r"<text\b", text)
    assert "dc:description" in text and "seed 7" in text


def test_png_text_chunk_and_print_resolution(saved):
    data = saved["png"].read_bytes()
    assert b"tEXt" in data or b"iTXt" in data or b"zTXt" in data
    chunks = [data[m.end() : m.end() + 200] for m in re.finditer(b"(tEXt|iTXt)", data)]
    assert any(b"seed 7" in chunk for chunk in chunks)
    # 300 dpi: pHYs holds pixels per metre (11811).
    start = data.index(b"pHYs") + 4
    assert int.from_bytes(data[start : start + 4], "big") == 11811


def test_eps_has_no_type3_font(saved):
    data = saved["eps"].read_bytes()
    assert b"FontType 3" not in data and b"/FontType 42" in data


def test_no_title_no_caption_draws_no_text_above(results):
    ax = plot_eigenvalues(results["top5"], style="column")
    figure = add_title(ax, None, None, metadata="settings")
    assert figure._suptitle is None and ax.get_title() == ""
    plt.close(figure)


def test_style_context_restores_the_rc():
    before = matplotlib.rcParams["font.size"]
    with figure_style("column"):
        assert matplotlib.rcParams["font.size"] == 8.0
        figure, _ = new_figure("column")
    assert matplotlib.rcParams["font.size"] == before
    plt.close(figure)


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    """One small analyze run for a paper: page style, no title, no caption."""
    from spectra.cli import main

    out = tmp_path_factory.mktemp("paper") / "run"
    args = ["analyze", "data/gd_trajectory/step_0200.keras", "--data", "data/digits.npz"]
    args += ["--loss", "sparse_categorical_crossentropy", "--max-examples", "100"]
    args += ["--top-k", "1", "--seed", "5", "--trace", "--trace-products", "8"]
    args += ["--style", "page", "--no-title", "--caption", "none", "--format", "pdf,png"]
    assert main([*args, "--out", str(out), "--no-progress", "--quiet"]) == 0
    return out


@pytest.mark.slow  # about 10 s: an analyze run through TensorFlow
def test_cli_paper_figure(paper_run):
    """--style page --no-title --caption none: 6.75 in wide at 300 dpi, no title text in
    the PDF's page, the settings (seed, trace) in its metadata."""
    import json

    from PIL import Image

    with Image.open(paper_run / "eigenvalues.png") as image:
        width = image.size[0] / image.info["dpi"][0]
        text = image.text
    assert image.info["dpi"][0] == pytest.approx(300, abs=1)
    assert width == pytest.approx(6.75, abs=0.004)  # the preset's width exactly
    assert "Top eigenvalue of the Hessian" in text["Title"]
    assert "seed 5" in text["Description"] and "trace " in text["Description"]
    pdf = (paper_run / "eigenvalues.pdf").read_bytes()
    assert b"/FontFile2" in pdf and b"/Type3" not in pdf
    results = json.loads((paper_run / "results.json").read_text())
    assert "--style page" in results["command"]


@pytest.mark.slow  # shares the analyze run of test_cli_paper_figure
def test_cli_replot_in_another_style(paper_run, tmp_path):
    """spectra plot redraws the run in column style with a title and the full caption."""
    from PIL import Image

    from spectra.cli import main

    out = tmp_path / "replot"
    args = ["plot", str(paper_run / "results.json"), "--style", "column", "--caption", "full"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    with Image.open(out / "eigenvalues.png") as image:
        width = image.size[0] / image.info["dpi"][0]
    assert width == pytest.approx(3.25, abs=0.004)


def _analysis_figures(args, report):
    """The figures ``spectra analyze`` draws for ``report`` with the options of ``args``."""
    import dataclasses

    from spectra.cli.analyze import _figure_options, _settings
    from spectra.reports.analyze import analysis_figures

    recorded = _settings(args).record(report.settings["dtype"])
    report = dataclasses.replace(report, settings={**report.settings, **recorded})
    return analysis_figures(report, _figure_options(args))


def _layers_figure(args, layers, matrix, where):
    """The per-layer figure ``spectra analyze --layers`` draws with the options of ``args``."""
    from spectra.cli.analyze import _figure_options, _settings
    from spectra.reports.analyze import layers_figure

    return layers_figure(layers, _settings(args), _figure_options(args), matrix, where)


def _sharpness_figure(args, report, done, threshold, unit, step_source):
    """The figure ``spectra sharpness`` draws of the ``done`` entries of a sharpness.json
    record ``report`` with the options of ``args`` and ``threshold``."""
    from spectra.cli.sharpness import _figure_options, _settings
    from spectra.reports.sharpness import sharpness_figures

    settings = _settings(args)
    record = {
        **report,
        "settings": settings.record(),
        "warm_start": settings.warm_start,
        "checkpoints": done,
        "threshold": None if threshold is None else threshold.to_dict(),
        "step_unit": unit,
        "step_source": step_source,
    }
    (drawn,) = sharpness_figures(record, _figure_options(args))
    return drawn.figure


def _sharpness_record(threshold):
    entry = {
        "status": "done",
        "eigenvalues": [2.9],
        "error_bounds": [1e-6],
        "converged": [True],
        "failure_probability": 1e-5,
        "trace": None,
        "trace_stderr": None,
        "loss": 1.2,
    }
    done = [{**entry, "step": step, "loss": 2.0 - 0.2 * step} for step in (5, 10, 15)]
    report = {
        "model": {"name": "adam_mlp", "num_parameters": 1210},
        "data": {"name": "adam_data", "num_examples": 400},
        "learning_rate": 0.01,
        "threshold": None if threshold is None else threshold.to_dict(),
    }
    return report, done


@pytest.mark.parametrize("recorded", [False, True])
def test_cli_sharpness_of_raw_h_under_adam_draws_no_threshold(recorded, monkeypatch):
    """λ_max(H) of an Adam run: no threshold line, and the legend says why, whether the
    run dropped Adam's threshold (this version) or recorded it (an earlier one); with
    --preconditioned, Adam's threshold is drawn."""
    from spectra.analysis.stability import stability_threshold_of
    from spectra.cli._parser import build_parser
    from spectra.reports import sharpness

    monkeypatch.setattr(sharpness, "describe_data", lambda data: data["name"])
    adam = stability_threshold_of({"class_name": "Adam", "config": {"learning_rate": 0.01}})
    report, done = _sharpness_record(adam if recorded else None)
    args = build_parser().parse_args(["sharpness", "run", "--data", "d.npz", "--out", "o"])
    args.command_line = "spectra sharpness run"
    figure = _sharpness_figure(
        args, report, done, None if not recorded else adam, "step", "file names"
    )
    dashed = [
        line
        for axes in figure.axes
        for line in axes.get_lines()
        if line.get_linestyle() == "--" and len(line.get_xdata())
    ]
    assert not dashed
    texts = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert any(text.startswith("no ") and "λ₁(H)" in text for text in texts), texts
    assert not any("λ_max" in text for text in texts), texts
    assert not any("3800" in text or "(2+2β₁)" in text for text in texts)
    plt.close(figure)

    args.preconditioned = True
    report, done = _sharpness_record(adam)
    figure = _sharpness_figure(args, report, done, adam, "step", "file names")
    texts = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert any("(2+2β₁)" in text for text in texts)
    plt.close(figure)


def test_other_axes_of_a_users_figure_are_left_alone(results):
    figure, (mine, other) = plt.subplots(1, 2)
    other.plot([0, 1], [0, 1])
    figure.draw_without_rendering()
    size = other.xaxis.get_ticklabels()[0].get_fontsize()
    plot_eigenvalues(results["top5"], ax=mine, style="column")
    figure.draw_without_rendering()
    assert mine.xaxis.get_ticklabels()[0].get_fontsize() == 7.0
    assert other.xaxis.get_ticklabels()[0].get_fontsize() == size
    plt.close(figure)


@pytest.mark.parametrize("style", ["column", "page"])
@pytest.mark.parametrize("caption", ["short", "full"])
def test_layers_figure_keeps_title_and_caption_clear_of_the_axes(results, style, caption, tmp_path):
    # `spectra analyze --layers --trace --style page` put the panels side by side, and the
    # caption centred on the figure made the constrained layout collapse ("constrained_layout
    # not applied"): the title was drawn over the axes and the caption off the figure.
    from spectra.cli._parser import build_parser

    words = ["analyze", "m.keras", "--data", "d.npz", "--out", "o", "--layers", "--trace"]
    args = build_parser().parse_args([*words, "--style", style, "--caption", caption])
    where = (
        "digits_mlp, 85,002 parameters",
        "digits, 300 examples",
        "Hessian of the mean sparse_categorical_crossentropy (inference mode)",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "constrained_layout not applied"
        figure = _layers_figure(args, results["layers"], "Hessian", where)
        save_figure(figure, tmp_path / "layers.png")
        figure.draw_without_rendering()
    renderer = figure.canvas.get_renderer()
    assert figure.get_figwidth() == STYLES[style].width
    canvas = figure.bbox
    title = figure._suptitle.get_window_extent(renderer)
    text = _caption_text(figure)
    assert text is not None and text.get_text().startswith("digits_mlp, 85,002")
    below = text.get_window_extent(renderer)
    panels = [axes.get_window_extent(renderer) for axes in figure.axes]
    assert len(panels) == 2
    for box in (title, below):
        assert box.y1 <= canvas.y1
        assert all(not box.overlaps(panel) for panel in panels), (box, panels)
    assert canvas.x0 - 2 <= below.x0 and below.x1 <= canvas.x1 + 2  # as the other texts
    assert title.y0 >= below.y1 - 1.0  # the title above the caption
    assert below.y0 >= max(panel.y1 for panel in panels)
    if style == "page":  # side by side, the caption centred on the figure
        assert panels[0].y0 == pytest.approx(panels[1].y0)
        assert abs((below.x0 + below.x1) / 2 - canvas.width / 2) < 2.0
    plt.close(figure)


# --------------------------------------------------------------------------- fonts, legends


SERIF = ["STIXGeneral", "DejaVu Serif"]  # no Times-like family is installed here


@pytest.mark.parametrize("style", ["column", "page"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_plot_fits_its_print_size_in_serif(kind, style, results):
    """font="serif": the same print checks, every text (tick labels, title and caption
    made later included) in the Times-like family first, math in Computer Modern."""
    from spectra.plotting import resolve_font

    font = resolve_font("serif")
    assert font.families[-2:] == ("STIXGeneral", "DejaVu Serif") and font.math == "cm"
    before = dict(matplotlib.rcParams)
    ax = _draw(kind, results, style, font="serif")
    texts = _assert_fits_print(ax, kind, style, titled=True)
    for text in texts:
        assert text.get_fontfamily() == list(font.families), (text.get_text(), kind)
        assert text.get_fontproperties().get_math_fontfamily() == "cm", text.get_text()
    assert dict(matplotlib.rcParams) == before
    plt.close(ax.figure)


@pytest.mark.parametrize("style", ["column", "page"])
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "2d"])
def test_no_legend_draws_none_and_still_fits(kind, style, results):
    ax = _draw(kind, results, style, legend=False)
    figure = ax.figure
    _assert_fits_print(ax, kind, style, titled=True)
    assert not figure.legends
    assert all(axes.get_legend() is None for axes in figure.axes)
    plt.close(figure)


def test_fonts_by_name_and_unknown_names():
    from spectra.plotting import resolve_font

    assert resolve_font(None) is None
    assert resolve_font("sans").families == ("DejaVu Sans",)
    named = resolve_font("dejavu serif")  # as matplotlib spells it, case aside
    assert named.families == ("DejaVu Serif", "DejaVu Sans") and named.name == "DejaVu Serif"
    with pytest.raises(ValueError) as raised:
        resolve_font("Nowhere Grotesk")
    text = str(raised.value)
    assert "\n" not in text and "'Nowhere Grotesk'" in text
    assert "DejaVu Sans" in text and "'serif' and 'sans' always work" in text
    assert "cmr10" not in text  # matplotlib's math fonts are not offered as text fonts


def test_serif_files_embed_the_font_and_record_it(results, tmp_path):
    """PDF: the STIX font embedded as TrueType (no Type 3); PNG and PDF metadata name the
    style and the font; SVG keeps text in the serif family."""
    from PIL import Image

    ax = plot_sharpness(STEPS, SHARPNESS, lr=0.2, losses=LOSSES, style="column", font="serif")
    add_title(ax, "Sharpness", None, metadata="settings")
    paths = {fmt: save_figure(ax, tmp_path / f"serif.{fmt}") for fmt in ("pdf", "png", "svg")}
    plt.close(ax.figure)
    pdf = paths["pdf"].read_bytes()
    assert b"/Type3" not in pdf and b"/FontFile2" in pdf and b"STIXGeneral" in pdf
    with Image.open(paths["png"]) as image:
        keywords = image.text["Keywords"]
    assert keywords == "style column; font serif (STIXGeneral, DejaVu Serif; math cm)"
    assert "STIXGeneral" in paths["svg"].read_text()


# --------------------------------------------------------------------------- density axis


@pytest.fixture(scope="module")
def psd_density():
    """The SLQ density of a PSD operator (it says so): nodes >= 0, reflected at 0."""
    from scipy.sparse.linalg import aslinearoperator

    rng = np.random.default_rng(2)
    op = aslinearoperator(np.diag(np.r_[[9.0, 5.0], np.abs(rng.normal(0.0, 0.05, 98))]))
    op.is_positive_semidefinite = True
    density = spectral_density(op, num_steps=20, num_probes=4, seed=0, distribution="gaussian")
    assert density.positive_semidefinite
    return density


@pytest.mark.parametrize("style", ["column", "page"])
@pytest.mark.parametrize("log_scale", [True, False])
def test_psd_density_starts_at_zero(psd_density, style, log_scale):
    """A positive semidefinite density's λ axis starts at 0, not at a margin below it."""
    ax = plot_spectral_density(psd_density, log_scale=log_scale, style=style)
    _assert_fits_print(ax, "density", style, titled=False)
    assert ax.get_xlim()[0] == 0.0
    (line,) = [line for line in ax.get_lines() if line.get_gid() == "spectra-series"]
    assert line.get_xdata().min() == 0.0
    assert ax.get_yscale() == ("log" if log_scale else "linear")
    plt.close(ax.figure)


def test_negative_side_hidden_on_request(results):
    """A Hessian's density (nodes below 0) on λ >= 0 only with negative=False; by default
    its axis reaches below 0."""
    density = results["density"]
    assert density.nodes.min() < 0 and not density.positive_semidefinite
    shown = plot_spectral_density(density, style="column")
    assert shown.get_xlim()[0] < 0
    plt.close(shown.figure)
    ax = plot_spectral_density(density, negative=False, style="column")
    (line,) = [line for line in ax.get_lines() if line.get_gid() == "spectra-series"]
    assert ax.get_xlim()[0] == 0.0 and line.get_xdata().min() == 0.0
    plt.close(ax.figure)


# --------------------------------------------------------------------------- the CLI figures


def _analysis_report(results, density):
    from spectra.reports.analyze import AnalysisReport

    return AnalysisReport(
        command="spectra analyze m.keras",
        versions={},
        settings={"dtype": "float32"},
        data={"name": "digits", "num_examples": 300},
        model={"name": "digits_mlp", "num_parameters": 85002, "compiled_loss": None},
        loss=0.5,
        eigenvalues=results["top5"],
        eigenvalue_ratio=None,
        trace=None,
        density=density,
        density_moments=None,
        negative_mass=None,
        layers=results["layers"],
        layer_table=None,
        num_products=100,
        num_data_passes=20,
        wall_times={},
        files={},
    )


@pytest.mark.parametrize("style", ["column", "page"])
def test_cli_figures_in_serif_without_legend_and_labels(results, style):
    """`analyze --density --layers --font serif --no-legend --no-labels --no-density-log
    --no-density-negative`: no legend, no value labels, the serif font, the density linear
    on λ >= 0 (its caption says so), every figure fitting its print size."""
    from spectra.cli._common import figure_record
    from spectra.cli._parser import build_parser

    words = ["analyze", "m.keras", "--data", "d.npz", "--out", "o", "--density", "--layers"]
    words += ["--font", "serif", "--no-legend", "--no-labels", "--style", style]
    words += ["--no-density-log", "--no-density-negative", "--caption", "full"]
    args = build_parser().parse_args(words)
    args.command_line = "spectra " + " ".join(words)
    report = _analysis_report(results, results["density"])
    figures = _analysis_figures(args, report)
    assert [stem for _, stem, _ in figures] == ["eigenvalues", "density", "layers"]
    for _, stem, figure in figures:
        figure.draw_without_rendering()
        assert not figure.legends and all(axes.get_legend() is None for axes in figure.axes)
        assert all(not axes.texts for axes in figure.axes), stem  # no value labels
        texts = _texts(figure)
        assert all(text.get_fontfamily()[0] == "STIXGeneral" for text in texts), stem
        assert all(text.get_fontsize() >= 7.0 for text in texts), stem
        drawn, size = figure.get_tightbbox(), figure.get_size_inches()
        assert drawn.x0 >= -0.02 and drawn.x1 <= size[0] + 0.02, (stem, drawn)
        assert drawn.y0 >= -0.02 and drawn.y1 <= size[1] + 0.02, (stem, drawn)
    density_ax = figures[1][2].axes[0]
    assert density_ax.get_yscale() == "linear" and density_ax.get_xlim()[0] == 0.0
    record = figure_record(args, figures)
    assert record["settings"]["font"]["families"][:1] == ["STIXGeneral"]
    assert record["settings"]["legend"] is False and record["settings"]["labels"] is False
    assert "λ < 0 not drawn" in record["captions"]["density"]["caption"]
    assert "font serif" in record["captions"]["eigenvalues"]["keywords"]
    for _, _, figure in figures:
        plt.close(figure)


def test_cli_unknown_font_is_one_line(capsys):
    from spectra.cli import main

    status = main(["plot", "missing.json", "--font", "Nowhere Grotesk"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith("spectra: error: --font: matplotlib finds no font family")


def _sharpness_args(*extra):
    from spectra.cli._parser import build_parser

    args = build_parser().parse_args(["sharpness", "run", "--data", "d.npz", "--out", "o", *extra])
    args.command_line = "spectra sharpness run"
    return args


@pytest.mark.parametrize("style", ["column", "page"])
def test_compact_sharpness_figure(style, monkeypatch):
    """By default the sharpness figure draws no caption (it goes to the metadata and the
    record): its axes take a larger share of the height than with the short caption drawn
    (measured: 0.46 of it instead of 0.41 at column size, where the title and caption took
    26 % of the height and the title alone takes 15 %; 0.62 instead of 0.58 on a page)."""
    from spectra.cli._common import figure_record
    from spectra.plotting import figure_metadata
    from spectra.reports import sharpness

    monkeypatch.setattr(sharpness, "describe_data", lambda data: data["name"])
    report, done = _sharpness_record(None)
    shares = {}
    for caption in ("default", "short"):
        extra = ["--style", style] + ([] if caption == "default" else ["--caption", caption])
        args = _sharpness_args(*extra)
        figure = _sharpness_figure(args, report, done, None, "step", "file names")
        figure.draw_without_rendering()
        ax = figure.axes[0]
        shares[caption] = ax.get_window_extent().height / figure.bbox.height
        if caption == "default":
            assert ax.get_title() == "" and figure._suptitle is not None
            described = figure_metadata(figure)["Description"]
            assert "adam_mlp, 1,210 parameters" in described and "seed 0" in described
            record = figure_record(args, [("sharpness_figure", "sharpness", figure)], True)
            assert record["settings"]["caption"] == "none"
            assert record["captions"]["sharpness"]["caption"] == described
        plt.close(figure)
    assert shares["default"] > shares["short"] + 0.04, shares


def test_counts_read_as_number_and_noun():
    from spectra._format import count_text
    from spectra.plotting import print_text

    assert count_text(1, "example") == "1 example"
    assert count_text(898, "example") == "898 examples"
    assert count_text(1797, "subset") == "1,797 subsets"
    text = print_text("λᵢ of 5 subsets of 898 examples · 3 seeds")
    assert "5\u00a0subsets of 898\u00a0examples" in text and "3\u00a0seeds" in text
