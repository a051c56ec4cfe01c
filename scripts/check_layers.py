#!/usr/bin/env python3
"""Check weightsync's import graph from the AST (function-level imports included).

Three rules, each printed with the offending file and line:

* layers: a module may import only from its own layer or the layers below it
  (``LAYERS``, lowest first); the package root ``weightsync/__init__.py`` is the facade
  and may import any layer;
* no cycles between modules;
* nothing whose name starts with ``_`` is imported from another package (a name of
  ``weightsync.a.b`` is private to the package ``weightsync.a``).

Run by ``make test``; exits 1 on any violation.
"""

from __future__ import annotations

import ast
import os
import sys

LAYERS = ["core", "transport", "trainer", "rollout", "orchestration", "testing", "integrations",
          "tools"]
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def modules(root: str) -> dict[str, tuple[str, bool]]:
    out = {}
    for d, _, files in os.walk(os.path.join(root, "weightsync")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                is_pkg = rel.endswith(".__init__")
                out[rel[:-9] if is_pkg else rel] = (path, is_pkg)
    return out


def resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - level + 1]
    return ".".join(base + ([name] if name else []))


def imports(mod: str, path: str, is_pkg: bool, known: dict):
    """Yield ``(line, target module, imported names)`` for every weightsync import."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("weightsync"):
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            target = resolve(mod, is_pkg, node.level, node.module)
            if not target.startswith("weightsync"):
                continue
            plain = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in known:
                    yield node.lineno, sub, []
                else:
                    plain.append(a.name)
            if plain:
                yield node.lineno, target, plain


def layer(mod: str) -> int | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else -1


def package(mod: str, is_pkg: bool) -> str:
    return mod if is_pkg else mod.rpartition(".")[0]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root: str = ROOT) -> list[str]:
    known = modules(root)
    problems, graph = [], {}
    for mod, (path, is_pkg) in sorted(known.items()):
        here = os.path.relpath(path, os.path.join(root, ".."))
        for line, target, names in imports(mod, path, is_pkg, known):
            if target not in known:
                problems.append(f"{here}:{line}: imports {target}, which does not exist")
                continue
            graph.setdefault(mod, set()).add(target)
            src_l, dst_l = layer(mod), layer(target)
            if src_l is not None and dst_l is not None and src_l >= 0 and dst_l > src_l:
                problems.append(f"{here}:{line}: layer {LAYERS[src_l]} imports {target} "
                                f"(layer {LAYERS[dst_l]}, above it)")
            if src_l == -1:
                problems.append(f"{here}:{line}: {mod} is outside the layer folders {LAYERS}")
            same = package(mod, is_pkg) == package(target, known[target][1])
            leaf = target.rpartition(".")[2]
            if not same and leaf.startswith("_") and leaf != "__init__":
                problems.append(f"{here}:{line}: imports private module {target}")
            for n in names:
                if n.startswith("_") and not same:
                    problems.append(f"{here}:{line}: imports private {n} from {target}")
    for comp in find_cycles(graph):
        problems.append("import cycle: " + " <-> ".join(comp))
    return problems


def main() -> int:
    problems = check(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    for p in problems:
        print(p)
    print(f"check_layers: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
