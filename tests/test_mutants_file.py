"""tests/MUTANTS.md, the list of equivalent and harmless mutants that `make mutate` leaves out
of the score, parses; every entry is well formed and still quotes its module's source; and
.ci/mutate.py's matcher finds an entry by module and changed lines, whatever the function."""

from __future__ import annotations

import importlib.util
import re
import sys
from difflib import unified_diff
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_mutate():
    spec = importlib.util.spec_from_file_location("_mutate", ROOT / ".ci" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and NamedTuple look their module up
    spec.loader.exec_module(module)
    return module


mutate = _load_mutate()
EQUIVALENTS = mutate.load_equivalents()


def _normalized_source(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    return {" ".join(line.split()) for line in path.read_text().splitlines()}


def _diff(before: str, after: str) -> str:
    return "\n".join(
        unified_diff(
            before.strip("\n").split("\n"),
            after.strip("\n").split("\n"),
            fromfile="a.py",
            tofile="a.py",
            lineterm="",
        )
    )


def test_the_file_parses_into_entries_of_the_mutated_modules() -> None:
    # 225 mutants were listed by name before the entries were keyed by module and changed
    # lines: 5 repeated another's change in the same module and share its entry, and 12
    # quoted lines the code no longer had (dropped), which left 208 entries. The rewrite of
    # XTrace's sketch algebra and of the eigensolver's drivers dropped 31 more (their mutants
    # are to be analysed again at the next make mutate): 177. XTrace's rank-deficient branch,
    # rewritten for singular test vectors, no longer has the 3 lines three entries quoted: 174.
    # block_size_for's arithmetic moved to operators/memory.py (not mutated): 173.
    assert len(EQUIVALENTS) >= 173
    mutated = {meta.removesuffix(".py").replace("/", ".") for _, meta, _ in mutate.MODULES}
    assert {module for module, _ in EQUIVALENTS} <= mutated


def test_every_entry_is_well_formed() -> None:
    for (module, lines), entry in EQUIVALENTS.items():
        where = f"{module} @@ {entry.hint}: {lines}"
        assert lines, where
        assert all(line[:1] in ("-", "+") and line[1:] == line[1:].strip() for line in lines)
        assert re.match(r"(Equivalent|Harmless)\b", entry.reason), where
        assert len(entry.reason) > 20, where
        assert entry.hint and all(
            re.fullmatch(r"\w+(\.\w+)?", name) for name in entry.hint.split(", ")
        ), where


def test_every_entry_quotes_lines_its_module_still_has() -> None:
    # An entry whose removed line the module no longer has (a variable renamed, a constant
    # named) lists no mutant any more: its mutants come back as survivors and count against
    # the score. `python .ci/mutate.py --rekey REV` (REV: a commit where the entries were
    # current) edits those it can as the code was edited; edit or drop the rest by hand.
    sources = {module: _normalized_source(module) for module, _ in EQUIVALENTS}
    stale = [
        f"{module} @@ {entry.hint}: {line}"
        for (module, lines), entry in EQUIVALENTS.items()
        for line in lines
        if line[0] == "-" and line[1:] not in sources[module]
    ]
    assert not stale, f"{len(stale)} stale lines in tests/MUTANTS.md:\n" + "\n".join(stale)


def test_a_mutant_is_found_after_its_function_is_renamed_and_reindented() -> None:
    original = """
def _renamed_lanczos(counter, b, scale, idx):
    if b.size:
        broke = b <= _breakdown_threshold(counter, 1.0) * scale[idx]
    return broke
"""
    mutant = original.replace("(counter, 1.0)", "(counter, 2.0)")
    assert mutant != original
    name = "spectra.estimators.krylov.x__renamed_lanczos__mutmut_7"
    entry = mutate.find_equivalent(EQUIVALENTS, name, _diff(original, mutant))
    assert entry is not None
    assert entry.reason.startswith("Harmless: doubles a breakdown tolerance")
    assert entry.hint == "batched_lanczos"  # where it was found: a hint, not matched

    # A method of a class, the same line indented once more.
    method = "spectra.estimators.krylov.xǁ_Solverǁstep__mutmut_1"
    indented = _diff(original.replace("\n", "\n    "), mutant.replace("\n", "\n    "))
    assert mutate.find_equivalent(EQUIVALENTS, method, indented) == entry

    # Another change of the same line, or the same change in another module: not listed.
    other = original.replace("(counter, 1.0)", "(counter, 3.0)")
    assert mutate.find_equivalent(EQUIVALENTS, name, _diff(original, other)) is None
    elsewhere = "spectra.estimators.density.x__renamed_lanczos__mutmut_7"
    assert mutate.find_equivalent(EQUIVALENTS, elsewhere, _diff(original, mutant)) is None


def test_a_removed_argument_line_matches_however_difflib_aligns_the_parenthesis() -> None:
    call = """
    value = max(
        float(np.max(np.abs(values), initial=0.0)),
        counter.norm_estimate,
    )
"""
    removed = call.replace("        counter.norm_estimate,\n", "")
    name = "spectra.estimators.eigensolvers.x__split_bounds__mutmut_3"
    # Whether difflib quotes the closing ")" as removed and added again or not, the key is
    # the removed line (both alignments occurred in mutmut's diffs of this line).
    assert mutate.changed_lines(_diff(call, removed)) == ("-counter.norm_estimate,",)
    assert mutate.find_equivalent(EQUIVALENTS, name, _diff(call, removed)) is not None


def test_a_malformed_file_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "MUTANTS.md"
    path.write_text(
        "# Mutants\n\n## Equivalent and harmless mutants\n\n### `spectra.estimators.krylov`\n\n"
        "Equivalent: a reason.\n\n```diff\n@@ f\n-a = 1\n+a = 2\n b = 3\n```\n"
    )
    with pytest.raises(ValueError, match=r"MUTANTS\.md:13: expected '@@ hint'"):
        mutate.load_equivalents(path)
    path.write_text(
        "## Equivalent and harmless mutants\n\n### `m`\n\nEquivalent: x.\n\n"
        "```diff\n@@ f\n-a = 1\n+a = 2\n@@ g\n-a  =  1\n+a = 2\n```\n"
    )
    with pytest.raises(ValueError, match="listed twice in m"):
        mutate.load_equivalents(path)


def test_module_of_reads_functions_and_methods() -> None:
    assert mutate.module_of("spectra.estimators.krylov.x__batched_lanczos__mutmut_103") == (
        "spectra.estimators.krylov"
    )
    assert mutate.module_of("spectra.operators.base.xǁCurvatureOperatorǁ_matmat__mutmut_1") == (
        "spectra.operators.base"
    )
    with pytest.raises(ValueError, match="mutant: 'krylov' is not a mutmut mutant name"):
        mutate.module_of("krylov")


def test_module_aliases_are_the_file_names_of_the_modules_they_name() -> None:
    files = {name.split(" ")[0]: Path(meta).stem for name, meta, _ in mutate.MODULES}
    for alias, name in mutate.ALIASES.items():
        assert files[name] == alias


def test_rekey_edits_an_entry_as_the_code_was_edited() -> None:
    # What `.ci/mutate.py --rekey REV` does to a stale entry: its "-" line becomes the line at
    # its place in the code now, and its "+" line gets the same edit, token by token.
    before = ["a = 1", "np.fill_diagonal(cosines, 0.0)", "return a"]
    after = ["a = 1", "np.fill_diagonal(differences, 0.0)", "return a"]
    edited = mutate._edited_line("np.fill_diagonal(cosines, 0.0)", before, after)
    assert edited == "np.fill_diagonal(differences, 0.0)"
    assert mutate._merge_line(
        "np.fill_diagonal(cosines, 0.0)", edited, "np.fill_diagonal(cosines, 1.0)"
    ) == ("np.fill_diagonal(differences, 1.0)")
    assert mutate._merge_line("x < 1e300", "x < LARGEST", "x <= 1e300") == "x <= LARGEST"
    # The mutated token itself was edited (a constant named): left to a person.
    assert mutate._merge_line("x < 1e300", "x < LARGEST", "x < 1e301") is None
    # A line deleted, or one that occurs twice, has no one place now.
    assert mutate._edited_line("return a", before, ["a = 1"]) is None
    assert mutate._edited_line("a = 1", [*before, "a = 1"], after) is None
