"""Mutation testing of spectra's numerical core, module by module (``make mutate``).

Runs mutmut (configured in the ``[mutmut]`` section of setup.cfg: the files it mutates, the
fast test files it runs) on one module at a time, then writes a report: per module the
mutants killed, survived, timed out and without covering tests, the score, and every
surviving mutant's diff. Mutants listed in tests/MUTANTS.md as equivalent (same module, same
changed source lines, whichever function they are in) are counted apart and left out of the
score:

    score = (killed + timeout) / (mutants - listed equivalents)

    python .ci/mutate.py                       # every module, report in out/mutation/
    python .ci/mutate.py lanczos trace         # some modules
    python .ci/mutate.py --jobs 1 --out DIR    # one worker; another report directory
    python .ci/mutate.py --report-only         # rewrite the report from the last run
    python .ci/mutate.py --rekey REV           # MUTANTS.md's stale entries edited as the
                                               # code was since REV (where they were current)
    python .ci/mutate.py trace \
        --only 'spectra.estimators.stochastic_trace.x_hutchinson_trace__mutmut_*'
                                               # some functions (the rest stay 'not run')
    python .ci/mutate.py eigenvalues --rerun survivors
                                               # after new tests: the survivors again

A run resumes: it tests the mutants without a result (all of them the first time, and all
of a module whose source changed since its last result); --rerun survivors or all says
otherwise.

Survivors in the operator's pass code that only several processes exercise are then run
against tests/operators/test_distributed.py with the mutant switched on in its worker processes
(see WORKER_TESTS); those it catches count as killed and are named in the report.

mutmut works in ./mutants (a copy of the sources with every mutant behind a switch) and
keeps its results there, so a module's results stay until it is run again. TensorFlow is
not fork-safe once it has run, so setup.cfg sets mutmut's forkserver isolation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS_FILE = ROOT / "tests" / "MUTANTS.md"

_BATCHES = "spectra.operators.batching.xǁBatchesǁ"
_OPERATOR = "spectra.operators.base.xǁCurvatureOperatorǁ"
# (name, mutmut meta file, mutant-name patterns). Slow tests are deselected in setup.cfg;
# the eigensolver's modules (estimators/eigensolvers.py and the modules it was split into:
# eigenvalue_bounds, eigenpairs, krylov_schur, power_iteration, block_eigensolver), the
# largest, run last.
MODULES: list[tuple[str, str, list[str]]] = [
    ("tridiagonal", "spectra/estimators/tridiagonal.py", ["spectra.estimators.tridiagonal.*"]),
    ("lanczos", "spectra/estimators/krylov.py", ["spectra.estimators.krylov.*"]),
    (
        "diagonal",
        "spectra/estimators/stochastic_diagonal.py",
        ["spectra.estimators.stochastic_diagonal.*"],
    ),
    ("density", "spectra/estimators/density.py", ["spectra.estimators.density.*"]),
    ("trace", "spectra/estimators/stochastic_trace.py", ["spectra.estimators.stochastic_trace.*"]),
    ("preamble", "spectra/estimators/_preamble.py", ["spectra.estimators._preamble.*"]),
    (
        "data (batches and weights)",
        "spectra/operators/batching.py",
        [
            "spectra.operators.batching.x__leading_dims__mutmut_*",
            "spectra.operators.batching.x__fingerprint__mutmut_*",
            *(
                f"{_BATCHES}{method}__mutmut_*"
                for method in (
                    "__init__",
                    "_count_arrays",
                    "_iterate_dataset",
                    "_count_dataset",
                    "__iter__",
                )
            ),
        ],
    ),
    (
        "operators/base (batches and weights)",
        "spectra/operators/base.py",
        [
            "spectra.operators.base.x_block_size_for__mutmut_*",
            *(
                f"{_OPERATOR}{method}__mutmut_*"
                for method in (
                    "_owned_batches",
                    "_prepare",
                    "_matmat",
                    "_iterate_caches",
                )
            ),
        ],
    ),
    (
        "operators/operator_core (loss, gradient, memory plan)",
        "spectra/operators/operator_core.py",
        ["spectra.operators.operator_core.*"],
    ),
    (
        "operators/layout (flat vectors)",
        "spectra/operators/layout.py",
        ["spectra.operators.layout.*"],
    ),
    ("symmetric", "spectra/_symmetric.py", ["spectra._symmetric.*"]),
    (
        "eigenvalue_bounds",
        "spectra/estimators/eigenvalue_bounds.py",
        ["spectra.estimators.eigenvalue_bounds.*"],
    ),
    ("eigenpairs", "spectra/estimators/eigenpairs.py", ["spectra.estimators.eigenpairs.*"]),
    ("krylov_schur", "spectra/estimators/krylov_schur.py", ["spectra.estimators.krylov_schur.*"]),
    ("power", "spectra/estimators/power_iteration.py", ["spectra.estimators.power_iteration.*"]),
    (
        "lobpcg",
        "spectra/estimators/block_eigensolver.py",
        ["spectra.estimators.block_eigensolver.*"],
    ),
    ("eigenvalues", "spectra/estimators/eigensolvers.py", ["spectra.estimators.eigensolvers.*"]),
]
# The modules' file names, accepted for the short names above.
ALIASES = {
    "krylov": "lanczos",
    "stochastic_diagonal": "diagonal",
    "stochastic_trace": "trace",
    "batching": "data",
    "base": "operators/base",
    "layout": "operators/layout",
    "operator_core": "operators/operator_core",
    "eigensolvers": "eigenvalues",
    "power_iteration": "power",
    "block_eigensolver": "lobpcg",
}
# Code that matters only with several processes or replicas (a failing worker's NaN that
# poisons the all-reduce, the zeros of a replica without a batch, the pass named in
# WorkerFailed) runs in the worker processes of tests/operators/test_distributed.py, where mutmut
# cannot see it: its survivors are run again against that file's tests, the mutant switched
# on in every process through MUTANT_UNDER_TEST. A failing test kills the mutant.
WORKER_TESTS = ["tests/operators/test_distributed.py"]
WORKER_FUNCTIONS = [
    f"{_OPERATOR}{method}__mutmut_*" for method in ("_prepare", "_matmat", "_iterate_caches")
]
DETECTED = ("killed", "timeout")
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped"}
STATUS.update({code: "timeout" for code in (36, -24, 24, 152, 255)})


def _status(code: int | None) -> str:
    if code is None:
        return "not run"
    return STATUS.get(code, "suspicious")


def module_of(mutant: str) -> str:
    """The dotted module of a mutmut mutant name: ``spectra.estimators.krylov`` for
    ``spectra.estimators.krylov.x__batched_lanczos__mutmut_103``, and ``spectra.operators.base``
    for a method's ``spectra.operators.base.xǁCurvatureOperatorǁ_matmat__mutmut_125``."""
    match = re.match(r"^([\w.]+?)\.x(?:ǁ|_)\w", mutant)
    if match is None or "__mutmut_" not in mutant:
        raise ValueError(
            f"mutant: {mutant!r} is not a mutmut mutant name (module.x_function__mutmut_N)"
        )
    return match.group(1)


def changed_lines(diff: str) -> tuple[str, ...]:
    """A mutant's key: the source lines its unified ``diff`` removes ("-...") and adds
    ("+..."), in order, each with its whitespace collapsed; file headers and "@@" lines are
    skipped. A text both removed and added (difflib re-aligning the closing ")" of a call
    whose argument line was removed) is left out as often as it occurs on both sides."""
    lines = diff.splitlines()
    if len(lines) >= 2 and lines[0].startswith("--- ") and lines[1].startswith("+++ "):
        lines = lines[2:]
    changed = [
        line[0] + " ".join(line[1:].split())
        for line in lines
        if line[:1] in ("+", "-") and not line.startswith("@@")
    ]
    removed = Counter(line[1:] for line in changed if line[0] == "-")
    added = Counter(line[1:] for line in changed if line[0] == "+")
    cancel = {"-": removed & added, "+": removed & added}
    cancel["+"] = Counter(cancel["+"])  # two budgets, spent apart
    key = []
    for line in changed:
        if cancel[line[0]][line[1:]] > 0:
            cancel[line[0]][line[1:]] -= 1
        else:
            key.append(line)
    return tuple(key)


class Equivalent(NamedTuple):
    """An entry of MUTANTS.md: why its mutants are equivalent or harmless, and the functions
    they were found in (a hint for the reader; never matched)."""

    reason: str
    hint: str


def load_equivalents(
    path: Path = EQUIVALENTS_FILE,
) -> dict[tuple[str, tuple[str, ...]], Equivalent]:
    """(module, changed lines) -> Equivalent, from the "Equivalent and harmless mutants"
    section of MUTANTS.md: per module a ``### `dotted.module` `` heading, then reasons, each a
    paragraph followed by a ```diff block whose entries are an "@@ hint" line and the
    entry's "-"/"+" lines. Raises ValueError, naming the line, for a malformed section."""
    if not path.exists():
        return {}
    text = path.read_text()
    heading = re.search(r"^## Equivalent and harmless mutants$", text, re.M)
    if heading is None:
        raise ValueError(f"{path}: no '## Equivalent and harmless mutants' section")
    start = heading.start()
    end = text.find("\n## ", start + 1)
    section = text[start : end if end >= 0 else len(text)]
    first_line = text[:start].count("\n") + 1
    entries: dict[tuple[str, tuple[str, ...]], Equivalent] = {}
    module, paragraph, block = None, [], None
    hint, lines = None, []

    def close_entry(number: int) -> None:
        if hint is None:
            return
        key = changed_lines("\n".join(lines))
        if not key:
            raise ValueError(f"{path}:{number}: entry '@@ {hint}' changes no line")
        if (module, key) in entries:
            raise ValueError(f"{path}:{number}: entry '@@ {hint}' is listed twice in {module}")
        entries[module, key] = Equivalent(" ".join(" ".join(paragraph).split()), hint)

    for number, line in enumerate(section.splitlines(), start=first_line):
        if block is not None:  # inside a ```diff block
            if line.startswith("```"):
                close_entry(number)
                block, hint, lines, paragraph = None, None, [], []
            elif line.startswith("@@"):
                close_entry(number)
                hint, lines = line[2:].strip(), []
            elif line[:1] in ("-", "+") and hint is not None:
                lines.append(line)
            else:
                raise ValueError(
                    f"{path}:{number}: expected '@@ hint', '-line' or '+line' in a diff block, "
                    f"got {line!r}"
                )
        elif line.startswith("### "):
            module, paragraph = line[4:].strip().strip("`"), []
        elif line.startswith("```diff"):
            if module is None or not paragraph:
                raise ValueError(f"{path}:{number}: a diff block without a module or a reason")
            block = True
        elif line.startswith("```"):
            raise ValueError(f"{path}:{number}: only ```diff blocks list mutants")
        elif line.strip() and module is not None:
            paragraph.append(line)
    if block is not None:
        raise ValueError(f"{path}: the last diff block is not closed")
    return entries


def find_equivalent(
    equivalents: dict[tuple[str, tuple[str, ...]], Equivalent], mutant: str, diff: str
) -> Equivalent | None:
    """The entry that lists ``mutant`` (whose unified diff is ``diff``): the same module
    and the same changed lines, whatever function it is in now; None when none does."""
    return equivalents.get((module_of(mutant), changed_lines(diff)))


def _mutmut(*args: str, log=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)  # mutmut puts ./mutants first on the path itself
    return subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=ROOT,
        env=env,
        stdout=log if log is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )


def _results(meta_file: str, patterns: list[str]) -> dict[str, int | None]:
    from fnmatch import fnmatchcase

    path = ROOT / "mutants" / (meta_file + ".meta")
    if not path.exists():
        return {}
    codes = json.loads(path.read_text())["exit_code_by_key"]
    return {
        name: code
        for name, code in sorted(codes.items())
        if any(fnmatchcase(name, pattern) for pattern in patterns)
    }


def _to_run(meta_file: str, patterns: list[str], rerun: str) -> list[str] | None:
    """The mutants to give mutmut (it tests every mutant named, whatever its last result),
    or None for the patterns themselves: every mutant of the module, as on a first run, after
    the module changed, or with ``rerun`` "all"."""
    meta, source = ROOT / "mutants" / (meta_file + ".meta"), ROOT / meta_file
    if rerun == "all" or not meta.exists() or source.stat().st_mtime > meta.stat().st_mtime:
        return None
    wanted = (None,) if rerun == "missing" else (0,)
    return [name for name, code in _results(meta_file, patterns).items() if code in wanted]


def _differ(meta_file: str):
    """mutant name -> its diff against the original function, read from mutmut's copy of
    ``meta_file`` (parsed once; one ``mutmut show`` per mutant would start Python each time)."""
    from difflib import unified_diff

    import libcst
    from mutmut.mutation.diff_apply import read_mutant_function, read_original_function

    source = ROOT / "mutants" / meta_file
    parsed: list[libcst.Module] = []  # parsed on the first diff: large modules take a while

    def diff(mutant: str) -> str:
        if not source.exists():
            return "(mutmut's copy of the module is missing)"
        if not parsed:
            parsed.append(libcst.parse_module(source.read_text()))
        module = parsed[0]
        before, after = (
            libcst.Module([read(module, mutant)]).code.strip().split("\n")
            for read in (read_original_function, read_mutant_function)
        )
        return "\n".join(
            unified_diff(before, after, fromfile=meta_file, tofile=meta_file, lineterm="")
        )

    return diff


def _worker_tests(mutant: str, log) -> int:
    """pytest's exit status for WORKER_TESTS with ``mutant`` on ("" for none), run in
    mutmut's copy of the sources so that the worker processes import the mutants."""
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "MPLBACKEND": "Agg",
        "PYTHONPATH": str(ROOT / "mutants"),
        "MUTANT_UNDER_TEST": mutant,
    }
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    log.write(f"\n== {mutant or 'no mutant'}\n")
    log.flush()
    done = subprocess.run(
        [*command, *WORKER_TESTS], cwd=ROOT / "mutants", env=env, stdout=log, stderr=log
    )
    return done.returncode


def rerun_in_workers(meta_file: str, patterns: list[str], log) -> list[str]:
    """Run the surviving mutants of WORKER_FUNCTIONS against WORKER_TESTS; mark those the
    tests catch as killed in mutmut's results and return their names."""
    from fnmatch import fnmatchcase

    survivors = [
        name
        for name, code in _results(meta_file, patterns).items()
        if code == 0 and any(fnmatchcase(name, pattern) for pattern in WORKER_FUNCTIONS)
    ]
    if not survivors:
        return []
    if _worker_tests("", log) != 0:  # the tests must pass on the sources as they are
        print(f"  the multi-worker tests fail without a mutant; see {log.name}", flush=True)
        return []
    killed = [name for name in survivors if _worker_tests(name, log) == 1]
    path = ROOT / "mutants" / (meta_file + ".meta")
    meta = json.loads(path.read_text())
    for name in killed:
        meta["exit_code_by_key"][name] = 1
    path.write_text(json.dumps(meta, indent=4))
    return killed


def module_report(name: str, meta_file: str, patterns: list[str], equivalents) -> dict:
    results = _results(meta_file, patterns)
    counts = Counter(_status(code) for code in results.values())
    diff_of = _differ(meta_file)
    survivors, equivalent = [], []
    for mutant, code in results.items():
        if _status(code) in (*DETECTED, "not run"):
            continue
        diff = diff_of(mutant)
        listed = find_equivalent(equivalents, mutant, diff)
        entry = {"mutant": mutant, "status": _status(code), "diff": diff}
        if listed is None:
            survivors.append(entry)
        else:
            equivalent.append({**entry, "reason": listed.reason, "listed_in": listed.hint})
    total = len(results) - counts["not run"]
    detected = counts["killed"] + counts["timeout"]
    relevant = total - len(equivalent)
    return {
        "module": name,
        "file": meta_file,
        "mutants": total,
        "not_run": counts["not run"],
        "counts": dict(counts),
        "equivalent": equivalent,
        "survivors": survivors,
        "score": detected / relevant if relevant else None,
    }


def write_report(out: Path, modules: list[dict], runs: dict[str, dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"modules": modules, "runs": runs}, indent=2))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# Mutation testing report",
        "",
        f"Commit {commit or 'unknown'}; mutmut settings in setup.cfg; equivalent mutants from "
        "tests/MUTANTS.md. Score = (killed + timeout) / (mutants - equivalent).",
        "",
        "Mutants counts those run; an interrupted run leaves the rest 'not run'.",
        "",
        "| module | mutants | killed | timeout | survived | no tests | equivalent | score "
        "| not run | wall time | load (1 min) before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    totals = Counter()
    for m in modules:
        c = Counter(m["counts"])
        run = runs.get(m["module"], {})
        score = "–" if m["score"] is None else f"{100 * m['score']:.1f}%"
        wall = f"{run['seconds'] / 60:.1f} min" if "seconds" in run else "–"
        if run.get("invocations", 1) > 1:
            wall += f" ({run['invocations']} runs)"
        load = (
            f"{run['load_before']:.1f} / {run['load_after']:.1f}" if "load_before" in run else "–"
        )
        lines.append(
            f"| {m['module']} | {m['mutants']} | {c['killed']} | {c['timeout']} | "
            f"{c['survived']} | {c['no tests']} | {len(m['equivalent'])} | {score} | "
            f"{m.get('not_run', 0)} | {wall} | {load} |"
        )
        totals.update(c)
        totals["mutants"] += m["mutants"]
        totals["equivalent"] += len(m["equivalent"])
    relevant = totals["mutants"] - totals["equivalent"]
    if relevant:
        lines.append(
            f"| **all** | {totals['mutants']} | {totals['killed']} | {totals['timeout']} | "
            f"{totals['survived']} | {totals['no tests']} | {totals['equivalent']} | "
            f"{100 * (totals['killed'] + totals['timeout']) / relevant:.1f}% | "
            f"{totals['not run']} | | |"
        )
    in_workers = sorted(n for run in runs.values() for n in run.get("killed_in_workers", []))
    if in_workers:
        lines += [
            "",
            f"Killed by the multi-worker tests ({', '.join(WORKER_TESTS)}, the mutant on in "
            f"every worker process), counted as killed: {len(in_workers)}.",
            "",
            *(f"- `{name}`" for name in in_workers),
        ]
    for m in modules:
        if not m["survivors"]:
            continue
        lines += ["", f"## Surviving mutants: {m['module']}", ""]
        for s in m["survivors"]:
            lines += [f"### `{s['mutant']}` ({s['status']})", "", "```diff", s["diff"], "```", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")


def _merge_line(base: str, edited: str, mutated: str) -> str | None:
    """``mutated`` (a mutant of the line ``base``) with the edit that turned ``base`` into
    ``edited`` applied too: a three-way merge of tokens; None when the two changes touch the
    same tokens."""
    from difflib import SequenceMatcher

    tokens = [_TOKEN.findall(line) for line in (base, edited, mutated)]
    changes = []
    for side in (1, 2):
        matcher = SequenceMatcher(None, tokens[0], tokens[side], autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag != "equal":
                changes.append((i1, i2, side, tokens[side][j1:j2]))
    changes.sort(key=lambda change: (change[0], change[1]))
    for (i1, i2, side, _), (k1, k2, other, _) in itertools.pairwise(changes):
        if side != other and (k1 < i2 or (i1 == i2 == k1 == k2)):
            return None  # both edit the same tokens (or insert at the same place)
    merged, at = [], 0
    for i1, i2, _, replacement in changes:
        merged += tokens[0][at:i1] + replacement
        at = i2
    merged += tokens[0][at:]
    return " ".join("".join(merged).split())


def _edited_line(line: str, before: list[str], after: list[str]) -> str | None:
    """What the source line ``line`` (whitespace collapsed) of ``before`` became in ``after``:
    the line at its place in difflib's alignment of the two; None when it was deleted, occurs
    more than once, or its place is ambiguous."""
    from difflib import SequenceMatcher, get_close_matches

    if before.count(line) != 1:
        return None
    index = before.index(line)
    matcher = SequenceMatcher(None, before, after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if not i1 <= index < i2:
            continue
        if tag == "equal":
            return after[j1 + index - i1]
        if tag == "replace" and i2 - i1 == j2 - j1:
            return after[j1 + index - i1]
        if tag == "replace":
            close = get_close_matches(line, after[j1:j2], n=1, cutoff=0.6)
            return close[0] if close else None
        return None
    return None


def rekey(text: str, revision: str) -> tuple[str, list[str], list[str]]:
    """MUTANTS.md ``text`` with its stale entries (a removed line the module no longer has)
    edited as the code was edited since ``revision`` (a git revision where they were
    current): each stale "-" line becomes the line at its place now, and its "+" line gets the
    same edit (a three-way merge of tokens). Returns the text, the entries re-keyed and those
    left stale (to edit by hand)."""
    lines = text.split("\n")
    module, block, sources = None, False, {}
    rekeyed, left = [], []

    def source(name: str) -> tuple[list[str], list[str]]:
        if name not in sources:
            path = name.replace(".", "/") + ".py"
            old = subprocess.run(
                ["git", "show", f"{revision}:{path}"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            new = (ROOT / path).read_text()
            sources[name] = tuple(
                [" ".join(line.split()) for line in code.splitlines()] for code in (old, new)
            )
        return sources[name]

    def fix(start: int, end: int) -> None:  # the entry lines[start:end], "@@" first
        before, after = source(module)
        current = set(after)
        body = lines[start + 1 : end]
        stale = [line for line in body if line[0] == "-" and line[1:].strip() not in current]
        if not stale:
            return
        where = f"{module} {lines[start]}"
        edits = {}
        for line in body:
            if line[0] == "-":
                text = " ".join(line[1:].split())
                edits[text] = text if text in current else _edited_line(text, before, after)
        if None in edits.values():
            left.append(where)
            return
        removed = [" ".join(line[1:].split()) for line in body if line[0] == "-"]
        out = []
        for line in body:
            text = " ".join(line[1:].split())
            if line[0] == "-":
                out.append("-" + edits[text])
                continue
            from difflib import get_close_matches

            base = (get_close_matches(text, removed, n=1, cutoff=0.0) or [None])[0]
            merged = None if base is None else _merge_line(base, edits[base], text)
            if merged is None:
                left.append(where)
                return
            out.append("+" + merged)
        lines[start + 1 : end] = out
        rekeyed.append(where)

    index, entry = 0, None
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            module = None
        elif line.startswith("### "):
            module = line[4:].strip().strip("`")
        elif module and line.startswith("```diff"):
            block, entry = True, None
        elif block and (line.startswith("@@") or line.startswith("```")):
            if entry is not None:
                fix(entry, index)
            entry = index if line.startswith("@@") else None
            block = not line.startswith("```")
        index += 1
    return "\n".join(lines), rekeyed, left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [name.split(" ")[0] for name, _, _ in MODULES]
    parser.add_argument(
        "modules",
        nargs="*",
        metavar="MODULE",
        help=", ".join(names) + " (or the module's file name: " + ", ".join(ALIASES) + ")",
    )
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATE_JOBS", 2)))
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "mutation")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--rekey",
        metavar="REVISION",
        help="edit the stale entries of tests/MUTANTS.md as the code was edited since "
        "REVISION (a git revision where they were current), and stop",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="mutant names to run (mutmut's globs), within the chosen modules",
    )
    parser.add_argument(
        "--rerun",
        choices=("missing", "survivors", "all"),
        default="missing",
        help="which mutants to test: those without a result (default), the survivors, all",
    )
    args = parser.parse_args(argv)
    if args.rekey:
        text, rekeyed, left = rekey(EQUIVALENTS_FILE.read_text(), args.rekey)
        EQUIVALENTS_FILE.write_text(text)
        print(f"{len(rekeyed)} entries re-keyed; {len(left)} left stale, to edit by hand:")
        print("\n".join(f"  {where}" for where in left))
        return 0
    try:
        import mutmut  # noqa: F401
    except ImportError:
        parser.error("mutmut is not installed: pip install -e '.[test]'")
    args.modules = [ALIASES.get(name, name) for name in args.modules]
    unknown = sorted(set(args.modules) - set(names))
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose from {', '.join(names)}")
    chosen = [m for m in MODULES if not args.modules or m[0].split(" ")[0] in args.modules]
    args.out.mkdir(parents=True, exist_ok=True)
    runs_file = args.out / "runs.json"
    runs = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    equivalents = load_equivalents()
    for name, meta, patterns in chosen if not args.report_only else []:
        if args.only:
            prefix = meta.removesuffix(".py").replace("/", ".") + "."
            patterns = [glob for glob in args.only if glob.startswith(prefix)]
            if not patterns:
                continue
        log_path = args.out / f"{name.split(' ')[0].replace('/', '_')}.log"
        selected = _to_run(meta, patterns, args.rerun)
        what = "all mutants" if selected is None else f"{len(selected)} mutants"
        print(f"mutating {name}: {what} (log: {log_path})", flush=True)
        load_before, started = os.getloadavg()[0], time.monotonic()
        with log_path.open("w") as log:
            if selected == []:
                done = subprocess.CompletedProcess([], 0)
            else:
                chosen_mutants = patterns if selected is None else selected
                done = _mutmut("run", "--max-children", str(args.jobs), *chosen_mutants, log=log)
        with log_path.open("a") as log:
            in_workers = rerun_in_workers(meta, patterns, log)
        previous = runs.get(name, {}) if selected is not None else {}
        runs[name] = {
            # over the invocations since the module was last run whole
            "seconds": previous.get("seconds", 0.0) + time.monotonic() - started,
            "invocations": previous.get("invocations", 0) + 1,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "exit_status": done.returncode,
            "jobs": args.jobs,
            "killed_in_workers": sorted({*previous.get("killed_in_workers", []), *in_workers}),
        }
        runs_file.write_text(json.dumps(runs, indent=2))
        if done.returncode != 0:
            print(f"  mutmut exited with {done.returncode}; see {log_path}", flush=True)
    modules = [module_report(name, meta, patterns, equivalents) for name, meta, patterns in MODULES]
    modules = [m for m in modules if m["mutants"]]
    report = write_report(args.out, modules, runs)
    for m in modules:
        score = "–" if m["score"] is None else f"{100 * m['score']:.1f}%"
        print(f"{m['module']:40s} {m['mutants']:5d} mutants  {score}")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
