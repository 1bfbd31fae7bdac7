#!/usr/bin/env python3
"""Two house rules of CONTRIBUTING.md that review misses and a script does not:
no function in crates/*/src longer than 120 lines, and no import cycle between
the files (modules) of a crate. Prints each breach and exits 1 if there is one.
Relies on rustfmt's layout (scripts/test.sh checks formatting first)."""

import os
import re
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 120
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?"
                r"(?:extern\s+\"C\"\s+)?fn\s+(\w+)")


def code_lines(path):
    """The file's lines with line comments (doc comments included) blanked,
    and everything from a `#[cfg(test)]` module on dropped."""
    out = []
    for line in path.read_text().split("\n"):
        if line.strip() == "#[cfg(test)]":
            break
        out.append(re.sub(r"^\s*//.*$", "", line))
    return out


def long_functions(path):
    lines = code_lines(path)
    for start, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        indent = m.group(1)
        body = start
        while body < len(lines) and "{" not in lines[body]:
            if lines[body].rstrip().endswith(";"):
                break  # a declaration in a trait, no body
            body += 1
        if body == len(lines) or "{" not in lines[body]:
            continue
        end = body
        if lines[body].count("{") != lines[body].count("}"):
            end = body + 1
            while end < len(lines) and lines[end] != indent + "}":
                end += 1
        length = end - start + 1
        if length > MAX_FUNCTION_LINES:
            yield f"{path}:{start + 1}: fn {m.group(2)} is {length} lines (at most {MAX_FUNCTION_LINES})"


def module_of(src, path):
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def import_graph(src):
    files = {module_of(src, p): p for p in src.rglob("*.rs")}
    graph = {m: set() for m in files}
    for module, path in files.items():
        text = "\n".join(code_lines(path))
        parent = module if path.stem == "mod" else module[:-1]
        refs = [tuple(r.split("::")) for r in re.findall(r"\bcrate::((?:\w+::)*\w+)", text)]
        refs += [parent + tuple(r.split("::")) for r in re.findall(r"\bsuper::((?:\w+::)*\w+)", text)]
        for ref in refs:
            # The longest prefix naming a module of this crate.
            for n in range(len(ref), 0, -1):
                target = ref[:n]
                if target in files:
                    related = target[: len(module)] == module or module[: len(target)] == target
                    if not related:
                        graph[module].add(target)
                    break
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    root = Path(__file__).resolve().parent.parent
    os.chdir(root)
    breaches = []
    for src in sorted(Path("crates").glob("*/src")):
        for path in sorted(src.rglob("*.rs")):
            breaches.extend(long_functions(path))
        for component in cycles(import_graph(src)):
            names = ", ".join("::".join(m) or "lib" for m in component)
            breaches.append(f"{src}: import cycle between {names}")
    for breach in breaches:
        print(breach)
    if breaches:
        sys.exit(1)
    print("house rules hold: no function over 120 lines, no import cycle")


if __name__ == "__main__":
    main()
