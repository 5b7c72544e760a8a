"""The layout rules of `eqshard/`, read from the source's ASTs (nothing is imported).

The package is a house with wings (CONTRIBUTING.md, "Where things are"): the
door to JAX's moving parts (`_internals/`) at the bottom, importing nothing of
eqshard's, base modules at the root, then one private package per concern.
Imports run one way, down `WINGS`; there are no cycles, no `_private` name is
imported from another module, every name is imported from the module that
defines it (packages re-export), only `_internals/` reads JAX's moving parts or
matches on an error's text, no module is over `MAX_MODULE_LINES` lines and no
function over `MAX_FUNCTION_LINES` lines of code (non-blank, non-comment,
docstring excluded), and every module is named in its wing's `__init__.py`
docstring (the map in the code) and in its wing's row of CONTRIBUTING.md's
module map. No public docstring is over `MAX_DOCSTRING_LINES` lines.

Today's violations are data (`ALLOWED_*` below): the tests pass while they hold
and fail when a new one appears, or when one listed is gone (then delete its
entry, so the lists only shrink). `python tests/test_architecture.py`, or
`python -m pytest -s -q tests/test_architecture.py -k stats`, prints the figures.
"""

import ast
import dataclasses
import functools
import io
import re
import tokenize
from collections.abc import Iterator, Mapping
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "eqshard"
NAME = "eqshard"

# The wings, lowest first. A module may import from its own wing and from any wing
# of an earlier row; never from a later row nor from another wing of its own row.
# `_internals` (the door to JAX's moving parts) imports nothing of eqshard's, so
# that every module, the base ones too, may recognise JAX's errors through it.
# `base` is the root's own modules; `eqshard` is the public surface (the root's
# `__init__.py`), which imports every wing but the command.
WINGS: tuple[tuple[str, ...], ...] = (
    ("_internals",),
    ("base",),
    ("_mesh",),
    ("_spectree",),
    ("_move",),
    ("_transforms",),
    ("_build", "_readers", "_checkpoint"),
    ("_step",),
    ("_search",),
    ("t5x", "compat"),
    ("eqshard",),
    ("_cli",),
    ("__main__",),
)

# The modules that stay at the root, in the base wing.
BASE = frozenset(
    {
        "_typing",
        "_tree",
        "_tree_utils",
        "_keys",
        "_report",
        "_deprecated",
        "_caches",
    }
)

# BEGIN FLAT: modules still at the root that belong to a wing (the move empties it).
FLAT: dict[str, str] = {}
# END FLAT

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Today's violations (each entry is checked to still be one; delete it when fixed).
ALLOWED_CYCLES: tuple[frozenset[str], ...] = ()
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset()
ALLOWED_LONG_MODULES: frozenset[str] = frozenset({})
ALLOWED_LONG_FUNCTIONS: frozenset[str] = frozenset({})

# JAX's, XLA's and orbax's moving parts (issue 34, item 3): only `eqshard/_internals/`
# reads them. Attributes read on anything, and those read on a jaxpr's equation (a
# name ending in `eqn`) or on anything but `self` (a traced program's).
INTERNAL_ATTRIBUTES = frozenset(
    {
        "eqns",
        "primitive",
        "invars",
        "outvars",
        "constvars",
        "effects",
        "__closure__",
        "__globals__",
        "global_state",
        "type_handlers",
        "unsafe_buffer_pointer",
    }
)
INTERNAL_ON_EQUATIONS = frozenset({"params"})
INTERNAL_BUT_ON_SELF = frozenset({"jaxpr", "consts"})
# Today's readers outside the door, as (module, attribute): the distributed client,
# orbax and the CPU buffers are moving into it; `program_key` and `_shard_map`'s
# constants read traced programs for the kept programs' keys.
ALLOWED_INTERNAL_READS: frozenset[tuple[str, str]] = frozenset()

# JAX's and XLA's errors recognised by their text or class name (issue 47): only
# `_internals/` matches on an error's text (`x in str(error)`, `str(error) == x`,
# `str(error).startswith(x)`) or its class's name (`type(error).__name__ == x`).
# Today's others, by module: `_cli._fit` matches eqshard's own message.
ALLOWED_ERROR_MATCHES: frozenset[str] = frozenset({"eqshard._cli._fit"})


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module names
    imported: str
    names: tuple[str, ...]  # the names taken from `imported` (empty: `import x`)
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(), filename=str(modules()[module]))


def _is_package(module: str) -> bool:
    return modules()[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The dotted module a `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[Import]:
    """Every import of an eqshard module by `module`, also inside functions; a name
    that is a submodule (`from . import t5x`) is an import of that submodule."""
    found = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == NAME:
                    found.append(Import(module, alias.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target.split(".")[0] != NAME:
                continue
            names = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules():
                    found.append(Import(module, sub, (), node.lineno))
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(module, target, tuple(names), node.lineno))
    return found


@functools.cache
def all_imports() -> list[Import]:
    return [i for m in modules() for i in imports(m) if i.imported != m]


def edges() -> set[tuple[str, str]]:
    """Distinct importer -> imported pairs."""
    return {(i.importer, i.imported) for i in all_imports()}


def wing(module: str) -> str:
    """The wing `module` belongs to (for a module still at the root, the one `FLAT`
    gives it)."""
    parts = module.split(".")
    if len(parts) == 1:
        return NAME
    if len(parts) > 2 or _is_package(module):
        return parts[1]
    if parts[1] == "__main__":
        return "__main__"
    if parts[1] in BASE:
        return "base"
    if parts[1] in FLAT:
        return FLAT[parts[1]]
    raise AssertionError(
        f"{module} is at the root of eqshard/ but is neither in BASE nor in a wing: "
        "put it in its wing's package (or in BASE, if it is a base module)."
    )


def rank(wing_name: str) -> int:
    for i, row in enumerate(WINGS):
        if wing_name in row:
            return i
    raise AssertionError(f"the wing {wing_name!r} is not in WINGS")


def upward(edge: tuple[str, str]) -> bool:
    """An import against the wings' direction: of a later row, or of another wing
    of the same row."""
    a, b = wing(edge[0]), wing(edge[1])
    return a != b and rank(b) >= rank(a)


def components(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components (Tarjan), in reverse topological order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            result.append(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def _graph(pairs: set[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph


def cycles(pairs: set[tuple[str, str]]) -> list[frozenset[str]]:
    """The groups of nodes that import each other, directly or not."""
    return [c for c in components(_graph(pairs)) if len(c) > 1]


def wing_edges() -> set[tuple[str, str]]:
    return {(wing(a), wing(b)) for a, b in edges() if wing(a) != wing(b)}


def longest_chain() -> list[str]:
    """The longest chain of imports (`a` imports `b` imports ...), modules that
    import each other counted once (the graph of cycles collapsed)."""
    graph = _graph(edges())
    groups = components(graph)  # reverse topological: imported groups first
    of = {v: g for g in groups for v in g}
    best: dict[frozenset[str], list[str]] = {}
    for g in groups:
        below = {of[w] for v in g for w in graph[v]} - {g}
        heads = sorted(below, key=min)  # ties go to the first name
        longest = max((best[h] for h in heads), key=len, default=[])
        best[g] = [min(g), *longest]
    return max((best[g] for g in sorted(groups, key=min)), key=len)


def _code_lines(source: str) -> set[int]:
    """The lines that hold code: not blank, not only a comment."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def _functions(
    node: ast.AST, prefix: str
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def function_lines() -> dict[str, int]:
    """Lines of code of every function and method (`module.Class.method`; a nested
    function's lines count in its own and in the enclosing one's)."""
    sizes = {}
    for module in modules():
        code = _code_lines(modules()[module].read_text())
        for name, fn in _functions(_tree(module), f"{module}."):
            lines = set(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
            first = fn.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines -= set(range(first.lineno, (first.end_lineno or 0) + 1))
            sizes[name] = len(lines & code)
    return sizes


def module_lines() -> dict[str, int]:
    return {m: len(p.read_text().splitlines()) for m, p in modules().items()}


def private_imports() -> set[tuple[str, str, str]]:
    """(importer, imported, name) of every `_private` name taken from another
    module (a module's own name may start with `_`)."""
    found = set()
    for i in all_imports():
        for name in i.names:
            if name.startswith("_") and not name.startswith("__"):
                found.add((i.importer, i.imported, name))
    return found


def defined(module: str) -> set[str]:
    """The names `module` binds itself at its top level (functions, classes,
    assignments; also under a top-level `if` or `try`), not those it imports."""
    names = set()
    nodes: list[ast.AST] = list(_tree(module).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try):
            nodes.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            nodes.extend(node.body)
    return names


def passed_on() -> set[tuple[str, str, str]]:
    """(importer, imported, name) of every name taken from a module that does not
    define it, only imports it: it should be taken from its home. Packages
    (`__init__.py`s: the root, the namespaces, the wings) re-export by design."""
    return {
        (i.importer, i.imported, name)
        for i in all_imports()
        if not _is_package(i.imported)
        for name in i.names
        if name not in defined(i.imported)
    }


def _reads(tree: ast.AST) -> set[str]:
    """The attributes of `INTERNAL_*` that `tree` reads."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else None
        on_equation = (name or "").endswith("eqn") or (
            isinstance(base, ast.Subscript)
            and isinstance(base.value, ast.Attribute)
            and base.value.attr == "eqns"
        )
        if (
            node.attr in INTERNAL_ATTRIBUTES
            or (node.attr in INTERNAL_BUT_ON_SELF and name != "self")
            or (node.attr in INTERNAL_ON_EQUATIONS and on_equation)
        ):
            found.add(node.attr)
    return found


def _texty(node: ast.AST) -> bool:
    """Whether `node` is a variable's text (`str(x)`, `repr(x)`) or its class's
    name (`type(x).__name__`, `x.__class__.__name__`)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = node.args
        return node.func.id in ("str", "repr") and [type(a) for a in args] == [ast.Name]
    if isinstance(node, ast.Attribute) and node.attr in ("__name__", "__qualname__"):
        of = node.value
        return (
            isinstance(of, ast.Call)
            and isinstance(of.func, ast.Name)
            and of.func.id == "type"
        ) or (isinstance(of, ast.Attribute) and of.attr == "__class__")
    return False


def error_matches(tree: ast.AST) -> list[int]:
    """The lines of `tree` that match on an object's text or class name: `in`
    with it on the right, `==`/`!=` with it on either side, or its
    `startswith`/`endswith`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                if (isinstance(op, ast.In | ast.NotIn) and _texty(right)) or (
                    isinstance(op, ast.Eq | ast.NotEq)
                    and (_texty(left) or _texty(right))
                ):
                    lines.append(node.lineno)
                left = right
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and _texty(node.func.value)
        ):
            lines.append(node.lineno)
    return lines


def outside_the_door() -> set[tuple[str, str]]:
    return {
        read
        for module in modules()
        if wing(module) != "_internals"
        for read in ((module, attr) for attr in _reads(_tree(module)))
    }


def metrics() -> dict[str, object]:
    """The figures of the layout (issue 34's "Show it")."""
    pairs = edges()
    fns = function_lines()
    sizes = module_lines()
    chain = longest_chain()
    largest = max(sizes, key=lambda m: sizes[m])
    longest = max(fns, key=lambda f: fns[f])
    return {
        "modules": len(modules()),
        "folders": len({p.parent for p in modules().values()}),
        "import statements": len({(i.importer, i.line) for i in all_imports()}),
        "edges (importer -> imported)": len(pairs),
        "longest import chain": f"{len(chain)} modules: {' -> '.join(chain)}",
        "module cycles": f"{len(cycles(pairs))} "
        f"({sum(map(len, cycles(pairs)))} modules)",
        "wing cycles": [sorted(c) for c in cycles(wing_edges())],
        "upward edges": len([e for e in pairs if upward(e)]),
        "private names across modules": len(private_imports()),
        f"modules over {MAX_MODULE_LINES} lines": len(
            [m for m in sizes if sizes[m] > MAX_MODULE_LINES]
        ),
        "largest module": f"{largest} ({sizes[largest]} lines)",
        f"functions over {MAX_FUNCTION_LINES} lines of code": len(
            [f for f in fns if fns[f] > MAX_FUNCTION_LINES]
        ),
        "longest function": f"{longest} ({fns[longest]} lines of code)",
    }


def _check(kind: str, found: set, allowed: frozenset | set) -> None:
    new = sorted(found - allowed)
    gone = sorted(allowed - found)
    assert not new, f"new {kind} (see this file's docstring): {new}"
    assert not gone, f"no longer {kind}: remove from the allowed ones: {gone}"


def test_every_module_has_a_wing():
    for module in modules():
        rank(wing(module))
    assert not set(FLAT) - {m.split(".")[1] for m in modules() if m.count(".") == 1}


def test_no_cycles_between_modules():
    found = cycles(edges())
    for group in found:
        assert any(group <= allowed for allowed in ALLOWED_CYCLES), (
            f"a new cycle of imports: {sorted(group)}"
        )
    for allowed in ALLOWED_CYCLES:
        assert any(allowed & group for group in found), (
            f"no longer a cycle: remove from ALLOWED_CYCLES: {sorted(allowed)}"
        )


def test_no_cycles_between_wings():
    allowed = {e for e in ALLOWED_UPWARD}
    pairs = {(wing(a), wing(b)) for a, b in edges() - allowed if wing(a) != wing(b)}
    assert not cycles(pairs)


def test_imports_run_down_the_wings():
    _check("upward imports", {e for e in edges() if upward(e)}, ALLOWED_UPWARD)


def test_no_private_names_across_modules():
    _check("private names across modules", private_imports(), ALLOWED_PRIVATE)


def test_module_size():
    sizes = module_lines()
    long = {m for m in sizes if sizes[m] > MAX_MODULE_LINES}
    _check(f"modules over {MAX_MODULE_LINES} lines", long, ALLOWED_LONG_MODULES)


def test_function_size():
    fns = function_lines()
    long = {f for f in fns if fns[f] > MAX_FUNCTION_LINES}
    _check(
        f"functions over {MAX_FUNCTION_LINES} lines of code",
        long,
        ALLOWED_LONG_FUNCTIONS,
    )


CONTRIBUTING = PACKAGE.parent / "CONTRIBUTING.md"


def module_map() -> dict[str, str]:
    """CONTRIBUTING.md's module map ("Where things are"): each row's text by its
    wing's folder (`_move`; `""` for the root's base modules)."""
    text = CONTRIBUTING.read_text()
    section = text[text.index("## Where things are") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-"}:
            continue
        if cells[0].startswith("root"):
            rows[""] = cells[1]
        elif cells[0].startswith("`") and cells[0].endswith("/`"):
            rows[cells[0].strip("`/")] = cells[1]
    return rows


def test_every_module_is_in_the_module_map():
    rows = module_map()
    missing = []
    for path in modules().values():
        folder = str(path.parent.relative_to(PACKAGE)).replace(".", "")
        if path.name == "__init__.py" and folder:
            assert folder in rows, f"CONTRIBUTING.md's module map has no row {folder}/"
            continue
        if f"`{path.name}`" not in rows.get(folder, ""):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, (
        f"not named in its wing's row of CONTRIBUTING.md's module map: {missing}"
    )


def test_names_are_imported_from_their_home():
    found = passed_on()
    assert not found, (
        "names imported from a module that only passes them on (import each from "
        f"the module that defines it): {sorted(found)}"
    )


def test_only_the_door_recognises_errors_by_text():
    found = {
        module
        for module in modules()
        if wing(module) != "_internals" and error_matches(_tree(module))
    }
    _check("matches on error text outside _internals/", found, ALLOWED_ERROR_MATCHES)


def test_the_error_text_check_sees_a_new_match():
    # The check itself: each kind of match is found; a lookup of the text in a
    # set of seen ones, and the text in a message, are not.
    source = (
        "def f(error, seen):\n"
        "    'word' in str(error)\n"  # 2
        "    type(error).__name__ == 'SomeError'\n"  # 3
        "    str(error).startswith('XLA')\n"  # 4
        "    'Other' != error.__class__.__name__\n"  # 5
        "    str(error) not in seen\n"
        "    message = f'{type(error).__name__}: {error}'\n"
    )
    assert error_matches(ast.parse(source)) == [2, 3, 4, 5]


def wing_docstring(folder: str) -> str:
    """The docstring of a wing's `__init__.py` (`""` for the root's base modules,
    whose map is the root's `__init__.py`), read from its AST."""
    init = PACKAGE / folder / "__init__.py"
    return ast.get_docstring(ast.parse(init.read_text())) or ""


def named_in(stem: str, text: str) -> bool:
    """Whether `text` names the module `stem`: `stem.py` in backticks (after a
    folder, `_internals/jaxpr.py`, or not), or `stem` alone opening a bullet."""
    name = re.escape(stem)
    return bool(
        re.search(rf"`(?:[\w/]+/)?{name}\.py`", text)
        or re.search(rf"^\s*- `{name}`", text, re.MULTILINE)
    )


def test_every_module_is_named_in_its_wing_docstring():
    # The wing docstrings are the map in the code: each names every module of
    # its wing (CONTRIBUTING.md's table, checked above, points at them).
    missing = []
    for path in modules().values():
        folder = str(path.parent.relative_to(PACKAGE)).replace(".", "")
        if path.name != "__init__.py" and not named_in(
            path.stem, wing_docstring(folder)
        ):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"not named in its wing's __init__.py docstring: {missing}"


def test_the_docstring_check_sees_an_unnamed_module():
    # The check itself: a module named only in passing (as a bare word, or as a
    # function of that name) is not named.
    text = "`_init.py` builds; see `_internals/jaxpr.py`;\n- `flow`: reads\n_shard"
    assert named_in("_init", text) and named_in("jaxpr", text)
    assert named_in("flow", text)
    assert not named_in("_shard", text) and not named_in("_pieces", text)
    assert not named_in("init", text)


# Public docstrings stay near 40 lines (CONTRIBUTING.md, "Write"): summary,
# behaviour, Arguments, Returns, Raises and one example; the narrative lives in
# the how-tos and on the API pages, linked from the docstring.
MAX_DOCSTRING_LINES = 45
NAMESPACES = ("eqshard", "eqshard.t5x", "eqshard.compat")


def definition(module: str, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    """The `def` or `class` that `module`'s `name` is, following re-exports
    (`from .x import name as name`); `None` for a value or a submodule."""
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    for node in _tree(module).body:
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}" in modules()
                if (alias.asname or alias.name) == name and not submodule:
                    return (
                        definition(source, alias.name) if source in modules() else None
                    )
    return None


def public_names(namespace: str) -> set[str]:
    """A namespace's `__all__` and the public names it re-exports outside it
    (the classes the root's readers return)."""
    names = set()
    for node in _tree(namespace).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names |= set(ast.literal_eval(node.value))
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname for a in node.names if a.asname == a.name}
    return {n for n in names if not n.startswith("_")}


def docstring_lengths(
    namespace: str, definitions: Mapping[str, ast.FunctionDef | ast.ClassDef]
) -> dict[str, int]:
    """Lines of each public function's and class's docstring, and of its
    classes' public methods' (`__call__` included), by qualified name."""
    lengths = {}
    for name, node in definitions.items():
        members: list[tuple[str, ast.FunctionDef | ast.ClassDef]] = [
            (f"{namespace}.{name}", node)
        ]
        if isinstance(node, ast.ClassDef):
            members += [
                (f"{namespace}.{name}.{m.name}", m)
                for m in node.body
                if isinstance(m, ast.FunctionDef)
                and (not m.name.startswith("_") or m.name == "__call__")
            ]
        for qualified, member in members:
            doc = ast.get_docstring(member)
            if doc is not None:
                lengths[qualified] = len(doc.splitlines())
    return lengths


def public_docstring_lengths() -> dict[str, int]:
    lengths = {}
    for namespace in NAMESPACES:
        found = {n: definition(namespace, n) for n in sorted(public_names(namespace))}
        defs = {n: d for n, d in found.items() if d is not None}
        lengths |= docstring_lengths(namespace, defs)
    return lengths


def test_public_docstrings_stay_short():
    lengths = public_docstring_lengths()
    # The walk reaches the everyday path and both namespaces' families.
    assert {"eqshard.shard", "eqshard.pipeline", "eqshard.StepReport"} <= set(lengths)
    assert {"eqshard.t5x.Partitioner.partition", "eqshard.compat.get_metrics"} <= set(
        lengths
    )
    long = {name: n for name, n in lengths.items() if n > MAX_DOCSTRING_LINES}
    assert not long, (
        f"public docstrings over {MAX_DOCSTRING_LINES} lines (keep the summary, "
        "behaviour, Arguments, Returns, Raises and one example; move the narrative "
        f"to the how-to or the API page and link it): {long}"
    )


def test_the_docstring_length_check_counts_methods():
    # The check itself: a class's public methods and `__call__` count, private
    # ones do not, and a docstring's lines are counted after dedenting.
    source = (
        "class C:\n"
        '    """One.\n\n    Two."""\n'
        '    def run(self):\n        """A\n        B\n        C"""\n'
        '    def __call__(self):\n        """D"""\n'
        '    def _hidden(self):\n        """E"""\n'
        "def f():\n    pass\n"
    )
    tree = ast.parse(source)
    defs = {
        node.name: node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    assert docstring_lengths("ns", defs) == {
        "ns.C": 3,
        "ns.C.run": 3,
        "ns.C.__call__": 1,
    }


def test_only_the_door_reads_jax_internals():
    _check(
        "reads of JAX's internals outside _internals/",
        outside_the_door(),
        ALLOWED_INTERNAL_READS,
    )


def test_the_door_check_sees_a_new_reader():
    # The check itself: each kind of read, written outside the door, is found;
    # `self`'s own attributes and other `params` (XLA's computations') are not.
    source = (
        "def f(closed, eqn, fn, self, computation):\n"
        "    closed.jaxpr.eqns[0].params['x']\n"
        "    eqn.primitive, eqn.params\n"
        "    fn.__globals__, jax.distributed.global_state\n"
        "    self.jaxpr, self.params, computation.params\n"
    )
    assert _reads(ast.parse(source)) == {
        "jaxpr",
        "eqns",
        "params",
        "primitive",
        "__globals__",
        "global_state",
    }


# The tests' own rule: a test waits for a child process (a script, the command, a
# launch of several processes) at least `MIN_RUN_TIMEOUT` seconds (they use
# `probes.RUN_TIMEOUT`), so that a loaded machine never fails working code; the
# limit is short only where the timeout itself is what a test checks.
TESTS = Path(__file__).resolve().parent
MIN_RUN_TIMEOUT = 600
_WAITS = {"run", "communicate", "run_processes", "check_output", "check_call"}
_WAITS |= {"wait", "settimeout"}
_TIMEOUTS_UNDER_TEST = {
    (
        "test_multihost_harness.py",
        "test_a_hanging_launch_times_out_with_stacks_and_leaves_no_process",
    ),
}


def short_timeouts(sources: dict[str, str]) -> list[tuple[str, str, int]]:
    """(file, top-level function, line) of every wait for a child process whose
    limit is a number under `MIN_RUN_TIMEOUT` (and of `run_processes`' default),
    in `sources` (file name: source)."""
    found = []
    for file_name, source in sources.items():
        tree = ast.parse(source)
        for top in tree.body:
            for node in ast.walk(top):
                limits: list[ast.expr | None] = []
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in _WAITS:
                        limits = [k.value for k in node.keywords if k.arg == "timeout"]
                        limits += node.args[:1] if name == "settimeout" else []
                elif isinstance(node, ast.FunctionDef) and node.name == "run_processes":
                    names = [a.arg for a in node.args.kwonlyargs]
                    limits = [node.args.kw_defaults[names.index("timeout")]]
                short = [
                    x
                    for x in limits
                    if isinstance(x, ast.Constant)
                    and isinstance(x.value, int | float)
                    and x.value < MIN_RUN_TIMEOUT
                ]
                name = getattr(top, "name", "<module>")
                if short and (file_name, name) not in _TIMEOUTS_UNDER_TEST:
                    found.append((file_name, name, getattr(node, "lineno", 0)))
    return found


def test_tests_wait_for_child_processes_long_enough():
    tests = {file.name: file.read_text() for file in sorted(TESTS.glob("*.py"))}
    assert short_timeouts(tests) == []
    # The check sees a short limit (and the harness's default).
    source = (
        "def test_x():\n    subprocess.run(['x'], timeout=120)\n"
        "def run_processes(fn, *, timeout: float = 60.0): ...\n"
    )
    assert short_timeouts({"probe.py": source}) == [
        ("probe.py", "test_x", 2),
        ("probe.py", "run_processes", 3),
    ]


def test_stats():
    figures = metrics()
    assert figures["modules"] == len(modules())
    print()
    for key, value in figures.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    for key, value in metrics().items():
        print(f"{key}: {value}")
