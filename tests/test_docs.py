"""The docs and bench/results/ agree (CPU only, no flux import).

Every result file that README.md or docs/*.md cites exists; every file in bench/results/
but its index is cited by them and listed in the index (bench/results/README.md), which
lists nothing else; docs/design.md is a design record: at most 500 lines and no run numbers.
A citation is a path written as ``bench/results/<name>``, or a bare name of the results'
form (``<what>-h200...``, ``<what>-h100...``); ``name.{log,json}`` stands for both files.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FULL = re.compile(r"bench/results/([A-Za-z0-9_.{},\-]*[A-Za-z0-9}])")
_BARE = re.compile(r"(?<![\w/.\-])([a-z][a-z0-9_]*(?:-[a-z0-9_]+)*-h[12]00[A-Za-z0-9_\-]*\.(?:\{[a-z,]+\}|[a-z]+(?:\.gz)?))")
_RUN = re.compile(r"\bruns?[\s_\-]*\d+", re.IGNORECASE)


def _expand(name):
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [name[:m.start()] + alt + name[m.end():] for alt in m.group(1).split(",")]


def _cited(text):
    names = set()
    for pattern in (_FULL, _BARE):
        for m in pattern.finditer(text):
            names.update(n.rstrip(".,") for n in _expand(m.group(1)))
    return names


def _result_files():
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p != INDEX and not p.name.startswith("."))


def _citations():
    return {doc.relative_to(ROOT).as_posix(): _cited(doc.read_text()) for doc in DOCS}


# An earlier result cited through git (`git show <commit>:bench/results/<file>`) need not be present.
_GIT_SHOW = re.compile(r"git\s+show\s+[0-9A-Za-z~^]+:bench/results/[A-Za-z0-9_.\-]+")


def test_cited_result_files_exist():
    present = set(_result_files()) | {INDEX.name}
    cited = {doc.relative_to(ROOT).as_posix(): _cited(_GIT_SHOW.sub("", doc.read_text())) for doc in DOCS}
    missing = {doc: sorted(names - present) for doc, names in cited.items() if names - present}
    assert not missing, f"cited result files that do not exist: {missing}"


def test_every_result_file_is_cited():
    cited = set().union(*_citations().values())
    uncited = [name for name in _result_files() if name not in cited]
    assert not uncited, f"files in bench/results/ that no doc cites: {uncited}"


def test_index_lists_exactly_the_result_files():
    listed = set(re.findall(r"^\| `([^`]+)` \|", INDEX.read_text(), re.MULTILINE))
    files = set(_result_files())
    assert listed == files, f"not in the index: {sorted(files - listed)}; indexed but absent: {sorted(listed - files)}"


def test_design_is_a_record_not_a_log():
    lines = (ROOT / "docs" / "design.md").read_text().splitlines()
    assert len(lines) <= 500, f"docs/design.md has {len(lines)} lines (at most 500)"
    runs = [f"{i}: {line.strip()}" for i, line in enumerate(lines, 1) if _RUN.search(line)]
    assert not runs, "docs/design.md names runs:\n" + "\n".join(runs)


def test_citation_patterns():
    assert _cited("see `bench/results/a-h200x2.json`, and b-h200.{log,json}.") == {
        "a-h200x2.json", "b-h200.log", "b-h200.json"}
    assert _cited("the SASS, `c-h200-sass.csv.gz`.") == {"c-h200-sass.csv.gz"}
    assert _cited("flux/autotune/shipped/tune-01a.json") == set()
    assert _RUN.search("in run 36") and _RUN.search("runs 26-31") and _RUN.search("x-run36.json")
    assert not _RUN.search("a rerun passed") and not _RUN.search("it runs the GEMM")
