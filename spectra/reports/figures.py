"""How the reports' figures are drawn and titled: the options (:class:`FigureOptions`, the
command line's figure options), the title and caption every figure gets
(:func:`finish_figure`), the record of both in a report (:func:`figure_record`) and the
phrases that name a run's model, data, matrix and eigensolver in captions.

The figures are drawn by :mod:`spectra.plotting`, imported when a figure is made (it
imports matplotlib).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from spectra.reports.base import InputSettings

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from spectra.plotting.style import FigureFont

__all__ = [
    "DrawnFigure",
    "FigureOptions",
    "describe_data",
    "describe_eigensolver",
    "describe_loss",
    "describe_matrix",
    "describe_model",
    "figure_record",
    "finish_figure",
]


class DrawnFigure(NamedTuple):
    """A report's figure, not yet saved: ``key`` names its files in the report's ``files``
    (``"eigenvalues_figure"``), ``stem`` is its file name without the format."""

    key: str
    stem: str
    figure: Figure


@dataclass(frozen=True, kw_only=True)
class FigureOptions:
    """How a report's figures are drawn (the command line's figure options).

    ``style``: the print size, ``"column"`` or ``"page"`` (None: matplotlib's settings);
    ``font``: ``"serif"``, ``"sans"`` or a font family matplotlib finds (None: matplotlib's);
    ``title``: a title above each figure; ``caption``: the settings line under it,
    ``"none"``, ``"short"`` or ``"full"`` (None: the figure's default, none for the compact
    sharpness figure and short for the others); ``legend``; ``labels``: values beside the
    eigenvalues' markers and the per-layer bars. An analysis' figures also read
    ``log_scale`` (the eigenvalue axis), ``density_log`` (the density axis) and
    ``density_negative`` (λ < 0 drawn); a sharpness run's ``plot_overlap`` (the overlap of
    consecutive eigenvectors drawn) and ``x_axis`` (``"steps"`` or ``"epochs"``, one the run
    recorded; None: the run's own axis).
    """

    style: str | None = "column"
    font: str | None = "sans"
    title: bool = True
    caption: str | None = None
    legend: bool = True
    labels: bool = True
    log_scale: bool = False
    density_log: bool = True
    density_negative: bool = True
    plot_overlap: bool = False
    x_axis: str | None = None

    def resolved_font(self) -> FigureFont | None:
        """The :class:`spectra.plotting.FigureFont` of ``font`` (None for None); a family
        matplotlib does not find is a ``ValueError`` listing some it does."""
        from spectra.plotting import resolve_font

        return resolve_font(self.font)

    def caption_choice(self, compact: bool = False) -> str:
        """``caption``, else the figure's default: ``"none"`` for a ``compact`` figure (the
        sharpness figure), ``"short"`` for the others."""
        return self.caption if self.caption is not None else ("none" if compact else "short")


# --------------------------------------------------------------------------- captions


def describe_model(model: Mapping[str, Any]) -> str:
    """``"digits_mlp, 85,002 parameters"`` of a report's ``model``."""
    return f"{model['name']}, {model['num_parameters']:,} parameters"


def describe_data(data: Mapping[str, Any]) -> str:
    """``"digits, 1,797 examples"`` of a report's ``data``."""
    return f"{data['name']}, {data['num_examples']:,} examples"


def describe_loss(
    loss: Any, loss_weights: Mapping[str, float] | None, model: Mapping[str, Any] | None
) -> str:
    """The loss as given, or the compiled loss recorded in a report's ``model``; per
    output ``"mse (out1) + 0.5·sparse_categorical_crossentropy (out2)"`` with the loss
    weights."""
    weights = loss_weights or {}
    if isinstance(loss, dict):
        return " + ".join(
            _weighted(weights.get(output), f"{name} ({output})")
            for output, name in loss.items()
            if name is not None
        )
    if loss is not None:
        text = str(loss)
    else:
        compiled = None if model is None else model.get("compiled_loss")
        text = f"compiled loss {compiled}" if compiled else "compiled loss"
    if weights:
        shown = ", ".join(f"{output} {weight:g}" for output, weight in weights.items())
        text += f" (loss weights {shown})"
    return text


def _weighted(weight: float | None, text: str) -> str:
    return text if weight is None or weight == 1 else f"{weight:g}·{text}"


def describe_matrix(settings: InputSettings, model: Mapping[str, Any] | None) -> str:
    """``"Hessian of the mean mse (inference mode, batches of 64)"``."""
    mode = "training mode" if settings.training else "inference mode"
    batches = f", batches of {settings.batch_size}" if settings.batch_size else ""
    loss = describe_loss(settings.loss, settings.loss_weights, model)
    return f"{settings.matrix} of the mean {loss} ({mode}{batches})"


def describe_eigensolver(method: str, tol: float, k: int, dtype: str) -> str:
    """``"Lanczos, k = 5, tol = 1e-08, float32 products"``."""
    return f"{method.capitalize()}, k = {k}, tol = {tol:g}, {dtype} products"


# --------------------------------------------------------------------------- titles


def finish_figure(
    fig_or_ax: Figure | Axes,
    options: FigureOptions,
    title: str,
    short: Sequence[object],
    full: Sequence[object] = (),
    *,
    matrix: str | None = None,
    seed: int | None = None,
    compact: bool = False,
) -> Figure:
    """Title and caption of a report's figure as ``options`` ask: the short caption is
    ``short`` (model, data, estimator; the title names the matrix), the full one adds the
    ``matrix`` description (loss, mode), ``full`` and the ``seed``; the full one goes into
    the file's metadata either way (:func:`spectra.plotting.add_title`). Without a caption
    option a ``compact`` figure (the sharpness figure) draws none
    (:meth:`FigureOptions.caption_choice`). Returns the figure."""
    from spectra.plotting import add_title, figure_caption

    complete = figure_caption(*short, matrix, *full, None if seed is None else f"seed {seed}")
    caption = {"none": None, "short": figure_caption(*short), "full": complete}[
        options.caption_choice(compact)
    ]
    shown = title if options.title else None
    return add_title(fig_or_ax, shown, caption, metadata={"Title": title, "Description": complete})


def figure_record(
    options: FigureOptions, figures: Sequence[tuple[str, str, Figure]], compact: bool = False
) -> dict[str, Any]:
    """What a report records of its figures (its ``figures``): the options they were drawn
    with (``settings``: style, font with the families found, title, caption, legend, value
    labels) and, for each figure ``(files key, stem, figure)``, the title and the full
    caption that its file's metadata holds, drawn or not."""
    from spectra.plotting import figure_metadata

    font = options.resolved_font()
    settings = {
        "style": options.style,
        "font": None if font is None else font.to_dict(),
        "title": options.title,
        "caption": options.caption_choice(compact),
        "legend": options.legend,
        "labels": options.labels,
    }
    captions = {}
    for _, stem, figure in figures:
        recorded = figure_metadata(figure)
        captions[stem] = {
            "title": recorded.get("Title"),
            "caption": recorded.get("Description"),
            "keywords": recorded.get("Keywords"),
        }
    return {"settings": settings, "captions": captions}
