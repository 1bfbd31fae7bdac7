#!/usr/bin/env python3
"""Two house rules of CONTRIBUTING.md that review misses and a script does not:
no function longer than 100 lines, and no import cycle between the files
(modules) of a crate, in crates/*/src and python/src. Prints each breach and
exits 1 if there is one. Unit tests count for length, not for imports: an
item under `#[cfg(test)]` may use anything.

A file depends on the file that *defines* each name it uses: a `use` or a path
(`crate::`, `super::`, `self::`, or a name in scope) is followed through `pub use`
re-exports and `use` aliases to the module where the item is written. A cycle
is allowed only among a module and its own descendants (a parent uses its
child, the child uses its parent); a cycle through siblings, or out of a
module's subtree and back, is a breach. Standard library only."""

import bisect
import functools
import re
import sys
from collections import deque
from pathlib import Path

MAX_FUNCTION_LINES = 100

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
WORD = re.compile(IDENT)
ITEM = re.compile(
    r"(?:fn|struct|enum|trait|type|union|const|static(?:\s+mut)?)\s+(?!fn\b)(" + IDENT + r")\b"
)
MOD = re.compile(r"\bmod\s+(" + IDENT + r")\s*([;{])")
USE = re.compile(r"use\s+")
PATH = re.compile(r"(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)")
RESTRICTED = re.compile(r"\bpub\s*\(\s*in\s+[^)]*\)")
CFG_TEST = re.compile(r"#\[cfg\(test\)\]")
CHAR = re.compile(r"b?'(?:\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'\n])'")
LITERAL_OR_COMMENT = re.compile(r"""//|/\*|(?<!\w)b?r#*"|(?<!\w)b'|"|'""")
KEYWORDS = {"crate", "super", "self"}


# --- Reading a file: code without comments, literals or tests ----------------


def strip(text):
    """`text` with comments and the insides of string and char literals turned
    into spaces (newlines kept, so offsets and line numbers still hold)."""
    out = list(text)
    i, n = 0, len(text)

    def blank(start, end):
        for k in range(start, end):
            if out[k] != "\n":
                out[k] = " "

    while m := LITERAL_OR_COMMENT.search(text, i):
        i, token = m.start(), m.group(0)
        if token == "//":
            end = text.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif token == "/*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif token.endswith('"') and token != '"':
            close = '"' + token[token.index("r") + 1 : -1]
            end = text.find(close, m.end())
            end = n if end < 0 else end + len(close)
            blank(m.end(), end - len(close))
            i = end
        elif token == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        elif c := CHAR.match(text, i):
            blank(i + 1, c.end() - 1)
            i = c.end()
        else:
            i = m.end()  # a lifetime
    return "".join(out)


def matching(code, start, open_="{", close="}"):
    """The offset just past the bracket that closes the one at `start`."""
    depth = 0
    for j in range(start, len(code)):
        if code[j] == open_:
            depth += 1
        elif code[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def item_end(code, start):
    """The offset just past the item that starts at `start`: its `;` or its
    brace-matched body, whichever comes first outside parentheses."""
    depth = 0
    for j in range(start, len(code)):
        c = code[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == ";":
            return j + 1
        elif depth == 0 and c == "{":
            return matching(code, j)
    return len(code)


def statement_end(code, start):
    """The offset just past the `;` that ends the statement at `start`."""
    depth = 0
    for j in range(start, len(code)):
        c = code[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == ";":
            return j + 1
    return len(code)


def without_tests(code):
    """`code` with every `#[cfg(test)]` item blanked."""
    while m := CFG_TEST.search(code):
        end = item_end(code, m.end())
        code = code[: m.start()] + re.sub(r"[^\n]", " ", code[m.start() : end]) + code[end:]
    return code


@functools.cache
def newlines(code):
    """Offsets of the newlines of `code` (computed once per file)."""
    return [j for j, c in enumerate(code) if c == "\n"]


def line_of(code, offset):
    return bisect.bisect_left(newlines(code), offset) + 1


# --- Function length ----------------------------------------------------------


def long_functions(path, code):
    for m in re.finditer(r"\bfn\s+(" + IDENT + r")", code):
        end = item_end(code, m.end())
        if code[end - 1] != "}":
            continue  # a declaration in a trait, no body
        first, last = line_of(code, m.start()), line_of(code, end - 1)
        length = last - first + 1
        if length > MAX_FUNCTION_LINES:
            yield (
                f"{path}:{first}: fn {m.group(1)} is {length} lines "
                f"(at most {MAX_FUNCTION_LINES})"
            )


# --- Modules, what each defines and imports -----------------------------------


class Module:
    """A module: a file, or a `mod name { … }` inside one."""

    def __init__(self, path, file, parent, source=None):
        self.path = path  # tuple of names from the crate root
        self.file = file  # tuple: the module path of the file that holds it
        self.parent = parent
        self.source = source  # the file's path, for a file's own module
        self.children = {}  # name → module path
        self.items = set()  # names defined here
        self.imports = {}  # name → segments
        self.uses = []  # (segments, line): every `use` leaf but globs
        self.globs = []  # (segments, line)
        self.references = []  # (segments, line): paths used in code
        self.identifiers = set()  # every identifier of its code, for globs


def module_of(src, path):
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def use_leaves(code, start, end, prefix=()):
    """(segments, bound name or '*', offset) for each leaf of the use tree in
    `code[start:end]`."""
    tree = code[start:end]
    if not tree.strip():
        return
    if tree.rstrip().endswith("}"):
        brace = start + tree.index("{")
        head = tuple(s.strip() for s in code[start:brace].split("::") if s.strip())
        close = start + tree.rindex("}")
        depth, part = 0, brace + 1
        for j in range(brace + 1, close + 1):
            c = code[j] if j < close else ","
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif c == "," and depth == 0:
                yield from use_leaves(code, part, j, prefix + head)
                part = j + 1
        return
    alias = None
    if m := re.fullmatch(r"(.*?)\s+as\s+(" + IDENT + r")\s*", tree, re.S):
        tree, alias = m.group(1), m.group(2)
    offset = start + len(tree) - len(tree.lstrip())
    segments = list(prefix) + [s.strip() for s in tree.split("::") if s.strip()]
    if segments[-1] == "*":
        yield segments[:-1], "*", offset
    elif segments[-1] == "self":
        yield segments[:-1], alias or segments[-2], offset
    else:
        yield segments, alias or segments[-1], offset


def scan(modules, module, code, start, end):
    """Records what `code[start:end]`, the body of `module`, defines, imports
    and references; a `mod name { … }` in it becomes a module of its own."""
    depth, i = 0, start
    while i < end:
        c = code[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if not (c.isalpha() or c == "_") or code[i - 1].isalnum() or code[i - 1] == "_":
            i += 1
            continue
        word = WORD.match(code, i).group(0)
        if word == "mod" and (m := MOD.match(code, i)):
            if depth == 0:
                child = module.path + (m.group(1),)
                module.children[m.group(1)] = child
                if m.group(2) == "{":
                    close = matching(code, m.end() - 1)
                    modules[child] = Module(child, module.file, module.path)
                    scan(modules, modules[child], code, m.end(), close - 1)
                    i = close
                    continue
            i = m.end() - 1
        elif word == "use" and (m := USE.match(code, i)):
            semicolon = statement_end(code, m.end())
            for segments, name, offset in use_leaves(code, m.end(), semicolon - 1):
                line = line_of(code, offset)
                if name == "*":
                    module.globs.append((segments, line))
                else:
                    module.imports[name] = segments
                    module.uses.append((segments, line))
            i = semicolon
        elif depth == 0 and (m := ITEM.match(code, i)):
            module.items.add(m.group(1))
            i = m.end()
        elif m := PATH.match(code, i):
            segments = [s.strip() for s in m.group(1).split("::")]
            module.references.append((segments, line_of(code, i)))
            module.identifiers.update(segments)
            i = m.end()
        else:
            module.identifiers.add(word)
            i += len(word)


def read_crate(src):
    modules = {}
    for path in sorted(src.rglob("*.rs")):
        module = module_of(src, path)
        if module in modules:
            sys.exit(f"{path}: a second file for module {'::'.join(module)}")
        modules[module] = Module(module, module, module[:-1] if module else None, path)
    for module in list(modules):
        if module:
            parent = modules.get(module[:-1])
            if parent:
                parent.children[module[-1]] = module
    codes = {}
    for module in sorted(m for m in modules if modules[m].file == m):
        path = modules[module].source
        code = strip(path.read_text())
        codes[module] = (path, code)
        # `pub(in crate::a)` names a module it does not use.
        code = RESTRICTED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), without_tests(code))
        scan(modules, modules[module], code, 0, len(code))
    return modules, codes


# --- Resolving a name to the module that defines it ---------------------------


class Resolver:
    """Names to the modules that define them, across `use`, `pub use` and
    globs; `busy` stops a chain of imports that comes back to itself."""

    def __init__(self, modules):
        self.modules = modules
        self.busy = set()

    def lookup(self, module, name):
        """What `name` in `module`'s namespace is: ('module', path), ('item',
        defining module path), or None (another crate, the prelude, a macro)."""
        m = self.modules.get(module)
        if m is None or (module, name) in self.busy:
            return None
        if name in m.children:
            return ("module", m.children[name])
        if name in m.items:
            return ("item", module)
        self.busy.add((module, name))
        try:
            if name in m.imports:
                return self.resolve(module, m.imports[name])
            for segments, _ in m.globs:
                target = self.resolve(module, segments)
                if target and target[0] == "module":
                    found = self.lookup(target[1], name)
                    if found:
                        return found
            return None
        finally:
            self.busy.discard((module, name))

    def resolve(self, module, segments):
        """Follows `segments`, a path written in `module`, to the module that
        defines what it names (the last module reached if it goes out of
        sight, e.g. into a macro or an enum's variants)."""
        if segments[0] == "crate":
            current, rest = ("module", ()), segments[1:]
        elif segments[0] in ("self", "super"):
            current, rest = ("module", module), segments
            while rest and rest[0] in ("self", "super"):
                if rest[0] == "super":
                    parent = self.modules[current[1]].parent
                    if parent is None:
                        return None
                    current = ("module", parent)
                rest = rest[1:]
        else:
            current, rest = self.lookup(module, segments[0]), segments[1:]
        for name in rest:
            if current is None or current[0] == "item":
                return current
            found = self.lookup(current[1], name)
            if found is None:
                return current
            current = found
        return current


def import_graph(modules):
    """file → {file it uses: (line, path written)}."""
    resolver = Resolver(modules)
    graph = {m.file: {} for m in modules.values()}

    def edge(m, target, line, written):
        if target:
            file = modules[target[1]].file
            if file != m.file and file not in graph[m.file]:
                graph[m.file][file] = (line, written)

    for m in modules.values():
        for segments, line in m.uses:
            target = resolver.resolve(m.path, segments)
            if target and target[0] == "item":
                edge(m, target, line, "::".join(segments))
        for segments, line in m.references:
            if segments[0] in KEYWORDS | m.imports.keys() | m.children.keys():
                edge(m, resolver.resolve(m.path, segments), line, "::".join(segments))
        for segments, line in m.globs:
            target = resolver.resolve(m.path, segments)
            if target and target[0] == "module":
                for name in sorted(m.identifiers):
                    found = resolver.lookup(target[1], name)
                    edge(m, found, line, "::".join(segments + [name]))
    return graph


# --- Cycles -------------------------------------------------------------------


def components(graph, nodes):
    """Strongly connected components of `graph` restricted to `nodes` (Tarjan,
    iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(w for w in graph[root] if w in nodes)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(x for x in graph[w] if x in nodes))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    found.append(component)
    return found


def shortest_path(graph, start, goal, nodes):
    """The fewest files from `start` to `goal` within `nodes` (breadth first)."""
    before, queue = {start: None}, deque([start])
    while queue:
        v = queue.popleft()
        if v == goal:
            path = []
            while v is not None:
                path.append(v)
                v = before[v]
            return path[::-1]
        for w in sorted(graph[v]):
            if w in nodes and w not in before:
                before[w] = v
                queue.append(w)
    return None


def forbidden_cycles(graph):
    """The breaches, as cycles of files. A cycle is allowed when one of its
    modules is an ancestor of all the others; otherwise the deepest module
    above them all, `top`, is not on it, and the cycle runs through two of
    `top`'s child subtrees. So for each `top`, a strongly connected component
    of its subtree without it that spans two child subtrees holds forbidden
    cycles (each is found at its own `top`). Yields one through each edge
    between two child subtrees that no cycle yielded before went through."""
    tops = {m[:k] for m in graph for k in range(len(m) + 1)}
    for top in sorted(tops):
        below = {m for m in graph if len(m) > len(top) and m[: len(top)] == top}
        for component in components(graph, below):
            branch = {m: m[len(top)] for m in component}
            reported = set()
            for u in sorted(component):
                for v in sorted(graph[u]):
                    if v in component and branch[u] != branch[v] and (u, v) not in reported:
                        cycle = [u] + shortest_path(graph, v, u, component)
                        reported.update(zip(cycle, cycle[1:]))
                        yield cycle


def main():
    root = Path(__file__).resolve().parent.parent
    breaches = []
    for src in sorted(root.glob("crates/*/src")) + [root / "python/src"]:
        modules, codes = read_crate(src)
        for path, code in codes.values():
            breaches.extend(long_functions(path.relative_to(root), code))
        graph = import_graph(modules)
        for cycle in forbidden_cycles(graph):
            steps = []
            for a, b in zip(cycle, cycle[1:]):
                line, written = graph[a][b]
                steps.append(f"{codes[a][0].relative_to(root)}:{line} uses {written}")
            names = " → ".join("::".join(m) or "crate" for m in cycle)
            steps = "".join(f"\n    {step}" for step in steps)
            breaches.append(f"{src.relative_to(root)}: import cycle {names}{steps}")
    for breach in breaches:
        print(breach)
    if breaches:
        sys.exit(1)
    print(f"house rules hold: no function over {MAX_FUNCTION_LINES} lines, no import cycle")


if __name__ == "__main__":
    main()
