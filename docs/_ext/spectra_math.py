"""Math as MathML, written when the site is built: pages that show their formulas offline.

Sphinx's default renderer leaves the LaTeX in the page (``\\(...\\)``, ``\\[...\\]``) for
MathJax, loaded from a CDN by the reader's browser: offline, the reader sees raw LaTeX.
This renderer converts each formula to MathML with ``latex2mathml`` (pure Python, in the
``docs`` extra), which browsers display natively: no script, no network when building or
viewing. A formula it cannot convert is a warning, so it fails ``make docs``.
"""

from __future__ import annotations

import html

from docutils import nodes
from latex2mathml.converter import convert
from sphinx.locale import _
from sphinx.util import logging
from sphinx.util.math import get_node_equation_number

logger = logging.getLogger(__name__)


def _mathml(node: nodes.Element, latex: str, display: str) -> str:
    try:
        return convert(latex.strip(), display=display)
    except Exception as error:  # latex2mathml raises its own exception types, and others
        logger.warning("MathML: cannot convert %r: %s", latex, error, location=node)
        return f"<code>{html.escape(latex)}</code>"


def visit_math(self, node: nodes.math) -> None:  # type: ignore[no-untyped-def]
    self.body.append(self.starttag(node, "span", "", CLASS="math notranslate"))
    self.body.append(_mathml(node, node.astext(), "inline"))
    self.body.append("</span>")
    raise nodes.SkipNode


def visit_math_block(self, node: nodes.math_block) -> None:  # type: ignore[no-untyped-def]
    self.body.append(self.starttag(node, "div", CLASS="math notranslate"))
    if node["number"]:
        number = get_node_equation_number(self, node)
        self.body.append(f'<span class="eqno">({number})')
        self.add_permalink_ref(node, _("Link to this equation"))
        self.body.append("</span>")
    # Equations separated by a blank line are shown one under the other, as Sphinx does.
    for part in node.astext().split("\n\n"):
        if part.strip():
            self.body.append(_mathml(node, part, "block"))
    self.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app):  # type: ignore[no-untyped-def]
    app.add_html_math_renderer(
        "mathml", inline_renderers=(visit_math, None), block_renderers=(visit_math_block, None)
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
