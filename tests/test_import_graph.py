"""Imports inside mimo point one way: no module reaches itself through imports, lazy
(function-level) imports included. Read statically from the source files (nothing imported), so
a circle hidden behind a function-level import, which Python tolerates until someone moves it to
the top of a file, is caught too.

Nodes are mimo's modules (a package's `__init__.py` is the package's node); an edge is any
`import`/`from ... import` anywhere in a file that names another mimo module (relative or
absolute; `from pkg import name` points at `pkg.name` when that is a module, else at `pkg`).

The negative control re-adds the circle issue #39 removed (mimo/hf/source.py reached back into
mimo/hf/convert.py for its dtype table inside `Source.dtype`, while convert.py imports `Source`
at the top) and checks that the same code finds it."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(root):
    """Dotted module name -> (source text, is a package's __init__)."""
    out = {}
    for d, _, files in os.walk(os.path.join(root, "mimo")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                is_pkg = rel.endswith(".__init__")
                with open(os.path.join(d, f)) as fh:
                    out[rel[:-len(".__init__")] if is_pkg else rel] = (fh.read(), is_pkg)
    return out


def import_graph(modules):
    """Module -> the mimo modules it imports anywhere in its file."""
    graph = {}
    for name, (text, is_pkg) in modules.items():
        pkg = name if is_pkg else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    mod = base + ("." + node.module if node.module else "")
                else:
                    mod = node.module or ""
                for a in node.names:
                    if f"{mod}.{a.name}" in modules:
                        deps.add(f"{mod}.{a.name}")
                    elif mod in modules:
                        deps.add(mod)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_mimo_imports_point_one_way():
    graph = import_graph(_modules(ROOT))
    assert "mimo.hf.source" in graph and "mimo.schedule.plan" in graph  # the walk found the packages
    assert cycles(graph) == []


def test_hf_source_does_not_import_convert():
    graph = import_graph(_modules(ROOT))
    assert "mimo.hf.source" in graph["mimo.hf.convert"]
    assert "mimo.hf.convert" not in graph["mimo.hf.source"]


def test_lazy_import_circle_is_caught():
    """Negative control: the old `Source.dtype` (a function-level `from .convert import _DTYPES`)
    put back into today's source.py makes the check fail, naming the two modules."""
    modules = _modules(ROOT)
    text, is_pkg = modules["mimo.hf.source"]
    old = ("\n\ndef _old_dtype(table_key):\n"
           "    from .convert import _DTYPES\n\n"
           "    return _DTYPES[table_key]\n")
    modules["mimo.hf.source"] = (text + old, is_pkg)
    assert cycles(import_graph(modules)) == [["mimo.hf.convert", "mimo.hf.source"]]


def test_absolute_and_package_level_imports_are_edges():
    """Negative control for the other spellings: `import mimo.x.y` inside a function, and
    `from mimo.hf import convert` (a submodule named through its package)."""
    modules = _modules(ROOT)
    text, is_pkg = modules["mimo.hf.mapping"]
    modules["mimo.hf.mapping"] = (text + "\n\ndef _f():\n    import mimo.hf.source\n", is_pkg)
    assert cycles(import_graph(modules)) == [["mimo.hf.mapping", "mimo.hf.source"]]
    modules = _modules(ROOT)
    text, is_pkg = modules["mimo.hf.mapping"]
    modules["mimo.hf.mapping"] = (text + "\nfrom mimo.hf import convert\n", is_pkg)
    assert cycles(import_graph(modules)) == [["mimo.hf.convert", "mimo.hf.mapping", "mimo.hf.source"]]
