"""The package's import graph against its layer order: no module imports one from a floor above
its own (lazy imports inside functions and TYPE_CHECKING imports included), and no two modules
import each other, directly or round a cycle. docs/architecture.md draws the same floors."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "graftlm"

# bottom to top; a module may import from its own floor and the floors below
FLOORS: list[list[str]] = [
    # the root: errors, the version, and the huge-page buffers (imports nothing of graftlm's)
    ["errors", "config", "resources", "hugepages", "__init__"],
    ["gguf"],
    ["step"],  # the batch, the KV cache and its allocator
    ["native"],  # bindings of the C kernels
    ["quant"],  # weights and their products
    ["lora"],  # adapter files, slots and their PyTorch delta
    ["tokenizer"],
    ["models"],  # families, the projection seam, the fused layer
    ["runtime"],  # scheduler, engine, service, prompting, sampling
    ["api"],
    ["server"],
    ["scaleout"],  # replicas of the server on Ray Serve
    ["commands", "cli", "__main__"],
]
# the root's `load` and `Model` come from api on first use (a module __getattr__): not an import
LAZY = {("graftlm", "graftlm.api")}
FLOOR_OF = {name: i for i, names in enumerate(FLOORS) for name in names}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _unit(module: str) -> str:
    """The floor a module belongs to: its subpackage, or its own name at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The graftlm modules `path` imports: `from graftlm.x import y` is an edge to graftlm.x.y
    where that is a module, else to graftlm.x."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("graftlm"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("graftlm"):
                for a in node.names:
                    sub = f"{name}.{a.name}"
                    out.add(sub if sub in modules else name)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        graph[mod] = {m for m in _imports(path, mod, set(files)) if m in files and m != mod}
    return graph


def test_every_package_has_a_floor() -> None:
    units = {_unit(m) for m in _graph()}
    assert units <= set(FLOOR_OF), f"give these a floor in FLOORS: {sorted(units - set(FLOOR_OF))}"


def test_no_import_goes_up() -> None:
    upward = [
        f"{mod} -> {dep}"
        for mod, deps in sorted(_graph().items())
        for dep in sorted(deps)
        if FLOOR_OF[_unit(dep)] > FLOOR_OF[_unit(mod)] and (mod, dep) not in LAZY
    ]
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(trail[trail.index(dep) :] + [dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "module",
    ["graftlm.step", "graftlm.native", "graftlm.quant", "graftlm.lora.site", "graftlm.models"],
)
def test_low_floors_import_alone(module: str) -> None:
    """Imported first in a fresh interpreter, a low floor loads nothing above it."""
    code = (
        f"import sys, {module}\n"
        "mods = {m.split('.')[1] for m in sys.modules if m.startswith('graftlm.')}\n"
        "print(' '.join(sorted(mods)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    floor = FLOOR_OF[_unit(module)]
    above = [u for u in done.stdout.split() if FLOOR_OF.get(u, 99) > floor]
    assert not above, f"importing {module} loaded {above}"
