# The Python code blocks of docs/ run as they are, so the pages cannot rot.
#
# The blocks of one page are one program, run top to bottom in a fresh namespace,
# in this process (conftest.py has already made the 8 virtual CPU devices that each
# page asks for), in a temporary working directory. A line
# `print(x)  # OUTPUT` or `print(x)  # OUTPUT: why` must print OUTPUT, where `...`
# stands for any text.
#
# A block that cannot run in one process (the multi-host example) is marked in the
# page source, on the line before its fence, with NOT_RUN: it is compiled and its
# eqshard names are checked, and only the pages in NOT_RUN_PAGES may hold one.

import pathlib
import re
import tempfile

import pytest

import eqshard


DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NOT_RUN = "<!-- not run by tests/test_docs.py: needs several processes -->"
NOT_RUN_PAGES = ["how-to/multi-host.md"]
FENCE = re.compile(
    r"^(?P<before>[^\n]*)\n```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S
)
SETUP = re.compile(r'^jax\.config\.update\("jax_num_cpu_devices", 8\)', re.M)
PRINT = re.compile(r"^(?P<indent> *)print\((?P<args>.*)\)  +# (?P<says>.*)$", re.M)


def _blocks(page: str) -> list[tuple[str, bool, str]]:
    """(language, runs, code) of each fenced block of `page`."""
    blocks = []
    for match in FENCE.finditer((DOCS / page).read_text()):
        blocks.append((match["lang"], match["before"] != NOT_RUN, match["code"]))
    return blocks


def _check_print(says: str, *args: object) -> None:
    """`print(*args)`, after checking that it prints what the comment `says`."""
    printed = " ".join(map(str, args))
    claims = [says] + [says[: colon.start()] for colon in re.finditer(": ", says)]
    patterns = [".*".join(map(re.escape, claim.split("..."))) for claim in claims]
    assert any(re.fullmatch(p, printed, re.S) for p in patterns), (
        f"printed {printed!r}, but the page says {says!r}"
    )
    print(printed)


PAGES = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
PYTHON_PAGES = [
    page
    for page in PAGES
    if any(lang == "python" and runs for lang, runs, _ in _blocks(page))
]


def test_fences_are_python_bash_or_text():
    # A Python block fenced as `py`, or left bare, would escape these tests.
    langs = {(page, lang) for page in PAGES for lang, _, _ in _blocks(page)}
    assert sorted(x for x in langs if x[1] not in ("python", "bash", "text")) == []
    assert len(PYTHON_PAGES) >= 8


def test_only_the_multi_host_page_has_blocks_that_do_not_run():
    pages = [p for p in PAGES if any(not runs for _, runs, _ in _blocks(p))]
    assert pages == NOT_RUN_PAGES


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_page_runs_and_prints_what_it_says(page, tmp_path, monkeypatch):
    code = "\n".join(c for lang, runs, c in _blocks(page) if lang == "python" and runs)
    # The devices exist already; a second config update would raise.
    code, setups = SETUP.subn("assert jax.device_count() == 8", code)
    assert setups <= 1, f"{page} sets the device count {setups} times"
    code, checked = PRINT.subn(
        lambda m: f"{m['indent']}_check_print({m['says']!r}, {m['args']})", code
    )
    monkeypatch.chdir(tmp_path)  # files the page writes land in tmp_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = {"__name__": "__main__", "_check_print": _check_print}
    exec(compile(code, str(DOCS / page), "exec"), namespace)


def test_print_comments_are_checked():
    with pytest.raises(AssertionError, match="the page says"):
        _check_print("P('tp', None)", "P('tp',)")
    _check_print("P(): scalars are replicated", "P()")
    _check_print("{'dp': 2, 'tp': 4}", "{'dp': 2, 'tp': 4}")
    _check_print("Mesh(..., spec=P('tp'))", "Mesh(shape=(2,), spec=P('tp'))")
    with pytest.raises(AssertionError):
        _check_print("Mesh(..., spec=P('tp'))", "Mesh(shape=(2,), spec=P('dp'))")


@pytest.mark.parametrize("page", NOT_RUN_PAGES)
def test_blocks_that_do_not_run_compile_and_name_real_api(page):
    blocks = [c for lang, runs, c in _blocks(page) if lang == "python" and not runs]
    assert blocks, f"{page} has no block marked {NOT_RUN!r}"
    for code in blocks:
        compile(code, str(DOCS / page), "exec")
        names = set(re.findall(r"\beqshard((?:\.\w+)+)", code))
        assert names and sorted(n for n in names if not _resolves(n)) == []
        methods = set(re.findall(r"\bpartitioner\.(\w+)", code))
        assert sorted(methods - set(dir(eqshard.t5x.Partitioner))) == []


def _resolves(dotted: str) -> bool:
    """Whether `eqshard` + `dotted` (".t5x.Partitioner") names an object: an old
    name warns, which the tests make an error."""
    owner: object = eqshard
    for name in dotted.removeprefix(".").split("."):
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True


# What a reader meets first: the README and the first pages say what to set on a
# planning machine, and why; every page runs as written outside the tests (where
# conftest.py has made the devices and set JAX_PLATFORMS); the new capabilities
# are one link away.

ROOT = DOCS.parent
FIRST_PAGES = ["README.md", "docs/index.md", "docs/quickstart.md"]
GPU_TARGET = re.compile(r"target=\"(?:h100|h200|b200|a100)", re.I)
SETS_CPU = re.compile(r"^os\.environ\[\"JAX_PLATFORMS\"\] = \"cpu\"", re.M)


@pytest.mark.parametrize("page", FIRST_PAGES)
def test_first_pages_say_what_to_set_on_a_planning_machine(page):
    text = " ".join((ROOT / page).read_text().split())
    assert "JAX_PLATFORMS=cpu" in text and "before `import jax`" in text
    assert "export JAX_PLATFORMS=cpu" in text  # exactly what to type
    assert "about 25 lines" in text and "start-up errors" in text  # and why


def test_pages_run_as_written_outside_the_tests():
    for page in PYTHON_PAGES:
        code = "\n".join(
            c for lang, runs, c in _blocks(page) if lang == "python" and runs
        )
        if "eqshard." in code:  # it makes meshes of the 8 virtual CPU devices
            assert SETUP.search(code), f"{page} does not ask for 8 CPU devices"
        if GPU_TARGET.search(code):  # compiled for GPUs on a machine without one
            first_import = code.index("import jax")
            found = SETS_CPU.search(code)
            assert found and found.start() < first_import, (
                f"{page} compiles for a GPU target without setting "
                "JAX_PLATFORMS=cpu before `import jax`"
            )


_CAPABILITIES = {
    "targets": "how-to/will-it-fit.md"
    "#for-a-pod-you-do-not-have-the-real-compilers-answer",
    "search_layout": "how-to/find-a-layout.md",
    "pipeline": "how-to/pipeline.md",
    "host": "how-to/will-it-fit.md#does-not-fit-offload-the-optimizer-state",
    "the step report": "how-to/step-report.md",
}


@pytest.mark.parametrize("page", FIRST_PAGES)
def test_the_new_capabilities_are_reachable_from_the_first_pages(page):
    text = (ROOT / page).read_text()
    if page == "docs/quickstart.md":
        text = text[text.index("## Next") :]
    prefix = "docs/" if page == "README.md" else ""
    links = set(re.findall(r"\]\(([^)\s]+)\)", text))
    missing = [k for k, target in _CAPABILITIES.items() if prefix + target not in links]
    assert missing == [], f"{page} does not link {missing}"
