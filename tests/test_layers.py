"""The package's layering is a checked contract: `lint-imports` reads the layers and the independence of the
placements from pyproject.toml ([tool.importlinter]) and fails on an import that runs up the layers. Also: no
import cycle between modules, no folder with a build-output name, no module named after a document number."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "alignrl"


def test_import_contracts_hold():
    out = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def runtime_nodes(tree: ast.AST):
    """The nodes of `tree` outside `if TYPE_CHECKING:` blocks (annotations only: not imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def module_imports() -> dict[str, set[str]]:
    """Every module's run-time imports of package modules (function-level ones included), by module name."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        names[name] = path
    graph = {}
    for name, path in names.items():
        found = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("alignrl"):
                    found.add(t)
        graph[name] = found
    return graph


def test_no_import_cycles_between_modules():
    graph, state, cycles = module_imports(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    sys.setrecursionlimit(10000)
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_build_output_names_and_no_document_numbers():
    folders = {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    assert not folders & {"dist", "build"}, "tools and .gitignore templates skip folders named dist or build"
    seeded = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "seed0" in p.name)
    assert not seeded, f"modules named after a document number: {seeded}"
