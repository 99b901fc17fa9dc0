"""The Python examples of the documentation run, and print what the pages say they print.

Each page's ```python blocks (docs/index.md, docs/guide/*.md, docs/reference/*.md) run in
order in a namespace of their own, as a reader would paste them, all pages in one fresh
interpreter (pages marked long: one each): working directory a temporary one where
``data`` links to the repository's (the examples read ``data/`` and write files),
``PYTHONPATH`` the repository root,
``TF_CPP_MIN_LOG_LEVEL=2``, ``MPLBACKEND=Agg``. A block followed by a ```text block that the
page introduces as its output (the text between them starts with "prints" and ends with a
colon: "prints:", "prints (on ...):") must print that text: the same lines, the same words,
and every number within one unit of its last printed digit (float32 products may round
differently on another CPU), as tests/test_readme.py checks the README's quickstart.

A block that cannot run here (several GPUs, a cluster, files that are not in the
repository) is marked in the page by a comment just above it, ``<!-- not run: REASON -->``;
each such block is a skipped test naming its reason. Text a page includes from the README
(``{include}`` of README.md) is run and checked by tests/test_readme.py, not again here.

Importing TensorFlow costs about 6 CPU-seconds, once for all the pages; the examples
use the digits MLP of data/ on a few hundred examples and few products. Pages whose
examples cost more (training, K-FAC factors, a language model) are marked ``long``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(
    [DOCS / "index.md", *(DOCS / "guide").glob("*.md"), *(DOCS / "reference").glob("*.md")]
)
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*\Z", re.S)
INCLUDE = re.compile(r"^```\{include\}\s+(\S+)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?(?:e([-+]?\d+))?")
MARKER = "@@spectra-docs-block {}@@"
MARKER_LINE = re.compile(r"^@@spectra-docs-block \d+@@\n?", re.M)

# Pages whose examples cost more than the suite's budget for this test (CPU-seconds on
# this project's 2-core machine, TensorFlow's import included): make test-all runs them.
LONG = {
    "guide/kfac.md": "K-FAC and EKFAC factors of two models, one a GPT-2 backbone",
    "guide/per-layer.md": "per-layer spectra, the preconditioned Hessian, block operators",
    "guide/tensorboard.md": "training with the callback, TensorBoard's event reader",
}


@dataclass
class Block:
    line: int  # the line of the page where the code starts (1-based)
    code: str
    output: str | None  # the text the page shows as its output, if any
    not_run: str | None  # the reason, for a block marked not run


def _blocks(page: Path) -> list[Block]:
    return _blocks_of(page.read_text())


def _blocks_of(text: str) -> list[Block]:
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        reason = NOT_RUN.search(text[fences[i - 1].end() if i else 0 : fence.start()])
        output = None
        if i + 1 < len(fences) and fences[i + 1].group(1) == "text":
            between = text[fence.end() : fences[i + 1].start()].strip()
            if between.startswith("prints") and between.endswith(":"):
                output = fences[i + 1].group(2)
        line = text.count("\n", 0, fence.start()) + 2
        blocks.append(Block(line, fence.group(2), output, reason and reason.group(1)))
    return blocks


def _name(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


def _numbers(text: str) -> list[tuple[float, float]]:
    """Each number printed in ``text`` with the size of one unit in its last digit."""
    found = []
    for match in NUMBER.finditer(text):
        decimals, exponent = match.group(1), match.group(2)
        unit = 10.0 ** (-len(decimals or "") + int(exponent or 0))
        found.append((float(match.group(0)), unit))
    return found


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def _check_output(where: str, printed: str, shown: str) -> None:
    got, want = _lines(printed), _lines(shown)
    assert len(got) == len(want), f"{where}: printed\n{printed}\nthe page shows\n{shown}"
    for actual, expected in zip(got, want, strict=True):
        context = f"{where}: printed {actual!r}, the page shows {expected!r}"
        assert NUMBER.sub("#", actual) == NUMBER.sub("#", expected), context
        for (value, unit), (number, _) in zip(_numbers(expected), _numbers(actual), strict=True):
            assert abs(number - value) <= unit * (1 + 1e-9), context


PAGE = "@@spectra-docs-page {}@@"
FAILED = "@@spectra-docs-failed@@{}@@spectra-docs-failed-end@@"
RUNNER = (
    """
import json, sys, traceback
for page, blocks in json.loads(sys.argv[1]):
    print("\\n" + PAGE.format(page), flush=True)
    namespace = {"__name__": "__main__"}
    for index, (line, code) in enumerate(blocks):
        print("\\n" + MARKER.format(index), flush=True)
        try:
            exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
        except BaseException:
            print("\\n" + FAILED.format(traceback.format_exc()), flush=True)
            break
        sys.stdout.flush()
""".replace("MARKER", repr(MARKER))
    .replace("PAGE", repr(PAGE))
    .replace("FAILED", repr(FAILED))
)
PAGE_LINE = re.compile(r"^@@spectra-docs-page (.*?)@@\n?", re.M)
FAILED_TEXT = re.compile(r"@@spectra-docs-failed@@(.*?)@@spectra-docs-failed-end@@", re.S)


def _run_pages(pages: list[Path], directory: Path) -> dict[str, str]:
    """Run the examples of ``pages`` in ONE fresh interpreter, each page in a namespace of
    its own (TensorFlow is imported once: about 6 CPU-seconds a page less), working in
    ``directory``, where ``data`` links to the repository's; page name -> what it printed."""
    (directory / "data").symlink_to(ROOT / "data", target_is_directory=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "MPLBACKEND": "Agg",
    }
    plan = [
        (str(page.relative_to(ROOT)), [(b.line, b.code) for b in _blocks(page) if not b.not_run])
        for page in pages
    ]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(plan)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"the examples' interpreter failed:\n{done.stderr[-4000:]}"
    parts = PAGE_LINE.split(done.stdout)[1:]
    printed = {
        str((ROOT / name).relative_to(DOCS).as_posix()): text
        for name, text in zip(parts[::2], parts[1::2])
    }
    assert len(printed) == len(pages), done.stdout[-4000:]
    return printed


def _check_page(page: Path, printed: str) -> None:
    blocks = [block for block in _blocks(page) if block.not_run is None]
    failed = FAILED_TEXT.search(printed)
    assert failed is None, f"{_name(page)} failed:\n{failed and failed.group(1)[-4000:]}"
    outputs = MARKER_LINE.split(printed)[1:]
    assert len(outputs) == len(blocks), printed[-4000:]
    for block, text in zip(blocks, outputs, strict=True):
        if block.output is not None:
            _check_output(f"{_name(page)}:{block.line}", text, block.output)


def _runnable(page: Path) -> bool:
    return any(block.not_run is None for block in _blocks(page))


@pytest.fixture(scope="module")
def printed_by_the_pages(tmp_path_factory) -> dict[str, str]:
    """What the examples of every page not marked long printed, from one interpreter."""
    pages = [page for page in PAGES if _runnable(page) and _name(page) not in LONG]
    return _run_pages(pages, tmp_path_factory.mktemp("docs_examples"))


@pytest.mark.slow
def test_the_page_examples_run_and_print_what_the_page_shows(printed_by_the_pages):
    # One test for the pages of make test: they share one interpreter (see _run_pages).
    failures = []
    for name, printed in printed_by_the_pages.items():
        try:
            _check_page(DOCS / name, printed)
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("page", [DOCS / name for name in sorted(LONG)], ids=sorted(LONG))
def test_the_long_page_examples_run_and_print_what_the_page_shows(page, tmp_path):
    _check_page(page, _run_pages([page], tmp_path)[_name(page)])


def _not_run_params():
    for page in PAGES:
        for block in _blocks(page):
            if block.not_run is not None:
                yield pytest.param(block, id=f"{_name(page)}:{block.line}")


@pytest.mark.parametrize("block", list(_not_run_params()))
def test_blocks_marked_not_run_say_why(block):
    assert len(block.not_run) >= 10, "a block left out says why"
    pytest.skip(f"not run: {block.not_run}")


def test_the_landing_page_includes_the_readme_quickstart():
    # The landing page shows the README's quickstart (code and output), which
    # tests/test_readme.py runs and checks against exact truths.
    landing = (DOCS / "index.md").read_text()
    (include,) = INCLUDE.finditer(landing)
    assert include.group(1) == "../README.md"
    options = dict(re.findall(r"^:([\w-]+):\s*\"?(.*?)\"?\s*$", include.group(2), re.M))
    readme = (ROOT / "README.md").read_text()
    start = readme.index(options["start-after"]) + len(options["start-after"])
    shown = readme[start : readme.index(options["end-before"], start)]
    assert "```python\nimport spectra" in shown and "\nprints:\n\n```text\n" in shown


def test_the_rules_read_the_pages_as_intended():
    # What the parser takes from a page, on a page written for it.
    text = (
        "# T\n\n```python\nprint(1)\n```\n\nprints:\n\n```text\n1\n```\n\n"
        "<!-- not run: needs a cluster of machines -->\n\n```python\nimport x\n```\n\n"
        "```python\nprint(2)\n```\n\n```text\nnot its output\n```\n"
    )
    blocks = _blocks_of(text)
    assert [(b.line, b.output, b.not_run) for b in blocks] == [
        (4, "1\n", None),
        (16, None, "needs a cluster of machines"),
        (20, None, None),
    ]
    _check_output("t", "x 1.24 [2 3]\n", "x 1.23 [2 3]\n")
    with pytest.raises(AssertionError):
        _check_output("t", "x 1.25\n", "x 1.23\n")
    with pytest.raises(AssertionError):
        _check_output("t", "y 1.23\n", "x 1.23\n")
