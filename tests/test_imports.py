"""The project's own import graph (issue 11): no cycle, and no project import hidden inside a function.

Every module of the library (`specache_jax`, `pallas_kernels`) and of the checkout's harness (`experiments`: the
launchers and `experiments.lib`; `configs`) is found on disk (pkgutil, nothing is imported) and parsed with
`ast`; each `import` / `from ... import` of a project module, at module level or inside a function, is an edge.
A function-level project import is allowed only with a comment on its line or the line above that says why:
"optional" (an optional backend) or "cycle-free: ..." (why it cannot be at the top).

The same edges between packages: every sub-package (`specache_jax.caches`, `specache_jax.model`,
`experiments.lib`, `experiments.lib.bench`, ...) is one node, a module directly under a top-level package
(`specache_jax.decode`, `experiments.niah`) its own node; that graph has no cycle either, and the library
imports nothing of the harness.

KNOWN_CYCLES and KNOWN_FUNCTION_IMPORTS list what is still to be fixed. Both are strict: a cycle or a hidden
import that is not listed fails, and so does a listed one that no longer exists (then delete its entry).
"""
from __future__ import annotations

import ast
import io
import pathlib
import pkgutil
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("specache_jax", "pallas_kernels")
HARNESS = ("experiments", "configs")
PACKAGES = LIBRARY + HARNESS
REASONS = ("optional", "cycle-free:")

# Strongly connected components of the import graph still to be broken (each as its set of modules).
KNOWN_CYCLES: list[frozenset[str]] = []
# (importing module, imported module) pairs of function-level imports still to be moved to the top or given
# a reason.
KNOWN_FUNCTION_IMPORTS: set[tuple[str, str]] = set()
MAX_LINES = 500                 # a module of the library or the harness
MAX_LAUNCHER_LINES = 100        # a launcher (experiments/*.py): flags or a config file -> one harness call
# Files still over MAX_LINES (strict, like the lists above).
KNOWN_LONG_FILES: set[str] = set()


def project_modules() -> dict[str, pathlib.Path]:
  """Module name -> source file, for every module and package of PACKAGES."""
  found = {}

  def walk(name: str, directory: pathlib.Path) -> None:
    found[name] = directory / "__init__.py"
    for info in pkgutil.iter_modules([str(directory)]):
      child = f"{name}.{info.name}"
      if info.ispkg:
        walk(child, directory / info.name)
      else:
        found[child] = directory / f"{info.name}.py"

  for package in PACKAGES:
    walk(package, ROOT / package)
  return found


def _reason_lines(source: str) -> set[int]:
  """Lines whose comment gives a reason for a function-level import."""
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT and any(r in tok.string for r in REASONS):
      lines.add(tok.start[0])
  return lines


def _targets(node: ast.AST, module: str, is_package: bool, modules) -> list[str]:
  """The project modules an import statement loads (for `from m import x`: m.x when that is a module, else m)."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
  else:
    base = node.module or ""
    if node.level:                                   # relative: resolve against the importing package
      package = module.split(".") if is_package else module.split(".")[:-1]
      package = package[:len(package) - node.level + 1]
      base = ".".join(package + ([base] if base else []))
    names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
  out = []
  for name in names:
    while name and name not in modules:              # `import a.b.c` of a non-module attribute path
      name = name.rpartition(".")[0]
    if name and name not in out:
      out.append(name)
  return out


def import_edges():
  """[(importer, imported, line, inside a function, a reason is given)] over every project module."""
  modules = project_modules()
  edges = []
  for module, path in sorted(modules.items()):
    source = path.read_text(encoding="utf-8")
    reasons = _reason_lines(source)
    tree = ast.parse(source, filename=str(path))

    def visit(node, in_function):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
          for target in _targets(child, module, path.name == "__init__.py", modules):
            if target != module:
              edges.append((module, target, child.lineno, in_function,
                            bool({child.lineno, child.lineno - 1} & reasons)))
        visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
  return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
  """Tarjan's components with more than one module (a module importing itself is skipped above)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(frozenset(component))

  for v in sorted(graph):
    if v not in index:
      connect(v)
  return out


def a_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
  """One concrete cycle inside a component, as a path that returns to its start."""
  start = min(component)
  path, seen = [start], {start}
  while True:
    step = min(w for w in graph[path[-1]] if w in component)
    if step in seen:
      return path[path.index(step):] + [step]
    path.append(step)
    seen.add(step)


@pytest.fixture(scope="module")
def edges():
  return import_edges()


def _graph(edges) -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {}
  for src, dst, *_ in edges:
    graph.setdefault(src, set()).add(dst)
  return graph


def package_node(module: str, files: dict[str, pathlib.Path]) -> str:
  """The package a module belongs to: its (sub-)package, or the module itself when it lies directly in a
  top-level package (those are leaves or entry points, not one unit)."""
  package = module if files[module].name == "__init__.py" else module.rpartition(".")[0]
  return module if package in PACKAGES else package


def _package_graph(edges) -> dict[str, set[str]]:
  files = project_modules()
  graph: dict[str, set[str]] = {}
  for src, dst, *_ in edges:
    a, b = package_node(src, files), package_node(dst, files)
    if a != b:
      graph.setdefault(a, set()).add(b)
  return graph


def test_the_walk_sees_the_whole_project(edges):
  modules = project_modules()
  assert {"specache_jax.caches.specache", "experiments.lib.bench.overlap", "pallas_kernels._common"} <= set(modules)
  assert ("specache_jax.model.decoder", "specache_jax.caches.attention") in {e[:2] for e in edges}


def test_no_import_cycle(edges):
  graph = _graph(edges)
  components = strongly_connected(graph)
  new = [" -> ".join(a_cycle(graph, c)) for c in components if c not in KNOWN_CYCLES]
  gone = [sorted(c) for c in KNOWN_CYCLES if c not in components]
  assert not new, "import cycles (break them; each line is one cycle):\n" + "\n".join(new)
  assert not gone, f"these listed cycles no longer exist; delete them from KNOWN_CYCLES: {gone}"


def test_no_package_cycle(edges):
  graph = _package_graph(edges)
  assert {"specache_jax.caches", "specache_jax.model", "experiments.lib", "experiments.lib.bench"} <= set(graph)
  cycles = [" -> ".join(a_cycle(graph, c)) for c in strongly_connected(graph)]
  assert not cycles, "package-level import cycles (each line is one):\n" + "\n".join(cycles)


def test_the_library_does_not_import_the_harness(edges):
  files = project_modules()
  wrong = sorted(f"{files[src].relative_to(ROOT)}:{line} imports {dst}" for src, dst, line, *_ in edges
                 if src.split(".")[0] in LIBRARY and dst.split(".")[0] in HARNESS)
  assert not wrong, "the library imports the harness (experiments/, configs/):\n" + "\n".join(wrong)


def test_no_project_import_hidden_in_a_function(edges):
  hidden = {(src, dst): line for src, dst, line, in_function, reason in edges if in_function and not reason}
  files = project_modules()
  new = sorted(f"{files[src].relative_to(ROOT)}:{line} imports {dst}" for (src, dst), line in hidden.items()
               if (src, dst) not in KNOWN_FUNCTION_IMPORTS)
  gone = sorted(KNOWN_FUNCTION_IMPORTS - set(hidden))
  assert not new, ("project imports inside a function: move them to the top, or say why on the line or the "
                   f"line above (a comment with one of {REASONS}):\n" + "\n".join(new))
  assert not gone, f"these listed imports are no longer hidden; delete them from KNOWN_FUNCTION_IMPORTS: {gone}"


def test_modules_are_small_and_launchers_thin():
  files = project_modules()
  long = {files[m].relative_to(ROOT).as_posix() for m in files
          if len(files[m].read_text(encoding="utf-8").splitlines()) > MAX_LINES}
  assert long == KNOWN_LONG_FILES, (f"over {MAX_LINES} lines: {sorted(long - KNOWN_LONG_FILES)}; no longer over "
                                    f"(delete from KNOWN_LONG_FILES): {sorted(KNOWN_LONG_FILES - long)}")
  launchers = [files[m] for m in files if m.startswith("experiments.") and package_node(m, files) == m]
  assert len(launchers) >= 10
  fat = [p.name for p in launchers if len(p.read_text(encoding="utf-8").splitlines()) > MAX_LAUNCHER_LINES]
  assert not fat, f"launchers over {MAX_LAUNCHER_LINES} lines (move their logic into experiments/lib/): {fat}"


def test_the_checker_finds_a_cycle_and_a_hidden_import():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
  (component,) = strongly_connected(graph)
  assert component == {"a", "b", "c"} and a_cycle(graph, component) == ["a", "b", "c", "a"]
  source = "def f():\n  import x  # optional backend\n\n\ndef g():\n  # cycle-free: x imports this module\n  import x\n"
  assert _reason_lines(source) == {2, 6}


def test_package_nodes():
  files = project_modules()
  assert package_node("specache_jax.caches.specache", files) == "specache_jax.caches"
  assert package_node("specache_jax.caches", files) == "specache_jax.caches"
  assert package_node("specache_jax.decode", files) == "specache_jax.decode"
  assert package_node("experiments.lib.bench.peer", files) == "experiments.lib.bench"
  assert package_node("experiments.niah", files) == "experiments.niah"
