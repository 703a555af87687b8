#!/usr/bin/env python3
"""Structure checks run by .ci/run: no module cycle inside any crate, no cycle between the files of any folder,
and no function longer than MAX_LINES in any crate (sources, tests and benches).

Module graph: a node per top-level module of a crate's src/ (a directory counts as one module, the crate root and
src/bin are left out); an edge M -> X for every `crate::X` path in M's code (use lines, grouped uses and inline
paths; comments and string literals ignored). A cycle is a strongly connected component with more than one node.

File graph, per folder of a crate's src/: a node per file or subfolder, the folder's own module file (mod.rs or
<folder>.rs) being `mod`; an edge A -> B for every path from A (or anything inside it) to B (or anything inside
it): `super::b`, `crate::folder::b`, `self::b` and bare `b::` paths; a path to an item of the folder's module itself
(`super::Engine`) goes to `mod`. Declaring a module (`mod b;`) is not an edge, using it is; `#[cfg(test)]` inline
modules are left out.

Function length: from the line of `fn` to its closing brace, braces counted outside comments, strings and chars.

README.md: at most README_MAX_LINES lines, so a newcomer reads it in five minutes; the reference material lives in
docs/.

Prints what it found; exits 1 on a cycle, an over-long function or an over-long README. Usage: .ci/structure.py [--verbose]
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["protocol", "agent-api", "image-store", "runtime", "containers", "agents", "sandboxd", "client", "sandboxctl", "conformance",
          "test-support", "egress", "e2b"]
LONG_FUNCTION_DIRS = ["sandboxd", "agent-api", "image-store", "containers", "agents", "runtime", "client", "sandboxctl", "conformance",
                      "protocol", "test-support", "egress", "e2b"]
MAX_LINES = 120
README_MAX_LINES = 250

FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)')


def strip_code(text):
    """The text with comments, string and char literals blanked (newlines kept), so braces and paths count."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        m = re.match(r'b?r(#*)"', text[i:i + 300])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(\\.[^']*|[^'\\])'", text[i:i + 12])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
                continue
        out.append(c)
        i += 1
    return "".join(out)


def rust_files(top):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d != "target"]
        for f in sorted(filenames):
            if f.endswith(".rs"):
                yield os.path.join(dirpath, f)


def module_graph(src):
    graph = {}
    for path in rust_files(src):
        rel = os.path.relpath(path, src).split(os.sep)
        if rel[0] in ("lib.rs", "main.rs", "bin"):
            continue
        node = rel[0][:-3] if rel[0].endswith(".rs") else rel[0]
        code = strip_code(open(path, encoding="utf-8").read())
        deps = set()
        for m in re.finditer(r"\bcrate::\{([^;]*)\}", code, re.S):
            for part in m.group(1).split(","):
                name = part.strip().split("::")[0].strip()
                if name:
                    deps.add(name)
        deps.update(re.findall(r"\bcrate::(\w+)", code))
        graph.setdefault(node, set()).update(deps)
    for node in graph:
        graph[node] = {d for d in graph[node] if d in graph and d != node}
    return graph


PATH_REF = re.compile(r"\b(crate|super|self)((?:\s*::\s*(?:\w+|\{[^{}]*\}|\*))+)")
INLINE_MOD = re.compile(r"(#\[cfg\(test\)\]\s*)?\bmod\s+(\w+)\s*\{")


def module_path(src, path):
    """The module path of a source file: src/a/b.rs and src/a/b/mod.rs are ["a", "b"]; the crate root is []."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


def inline_scopes(code):
    """(start, end, name) of every inline `mod name { ... }` block (nested ones too); a `#[cfg(test)]` one is named
    None (test code is left out of the file graph)."""
    scopes, stack, depth = [], [], 0
    opens = {m.end() - 1: (None if m.group(1) else m.group(2)) for m in INLINE_MOD.finditer(code)}
    for i, ch in enumerate(code):
        if ch == "{":
            depth += 1
            if i in opens:
                stack.append((i, depth, opens[i]))
        elif ch == "}":
            if stack and stack[-1][1] == depth:
                start, _, name = stack.pop()
                scopes.append((start, i, name))
            depth -= 1
    return scopes


def expand(tail):
    """The paths a `::a::{b, c::d}` tail names, each as a list of segments (one level of braces)."""
    tail = re.sub(r"\s+", "", tail).lstrip(":")
    m = re.match(r"((?:\w+::)*)\{(.*)\}$", tail)
    if m:
        head = [s for s in m.group(1).split("::") if s]
        return [head + [s for s in part.split("::") if s] for part in m.group(2).split(",") if part]
    return [[s for s in tail.split("::") if s]]


def file_references(src, path):
    """(the module the reference is made from, the absolute path it names) for every path in a file."""
    base = module_path(src, path)
    code = strip_code(open(path, encoding="utf-8").read())
    scopes = inline_scopes(code)
    for m in PATH_REF.finditer(code):
        here = list(base)
        for start, end, name in sorted(scopes):
            if start < m.start() < end:
                here.append(name)
        if None in here:
            continue
        # `super` in an inline module: the inline module's parent; leading `super::super` chains climb further.
        segments = [s.strip() for s in re.split(r"::", m.group(0), maxsplit=1)]
        kind = m.group(1)
        for names in expand(m.group(2)):
            if kind == "crate":
                target = names
            else:
                at = list(here)
                if kind == "super":
                    at = at[:-1]
                while names and names[0] == "super":
                    at = at[:-1]
                    names = names[1:]
                target = at + names
            yield here, [n for n in target if n not in ("self", "*")]
    # A bare path (`use plan::Blueprint`, `plan::check(..)`) names a child module of the file's own module.
    for m in re.finditer(r"(?<![:\w])(\w+)\s*::", code):
        if m.group(1) not in ("crate", "super", "self", "Self"):
            yield base, base + [m.group(1)]


def folder_cycles(src):
    """Cycles between the files of one folder: a node per file (the folder's own mod.rs or <folder>.rs is `mod`),
    an edge A -> B for every path from A (or from inside A) to B or something in it; a path to an item of the
    folder's module itself goes to `mod`. Declaring `mod b;` is not an edge; using it is."""
    folders = {}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d not in ("target", "bin")]
        if os.path.abspath(dirpath) == os.path.abspath(src):
            continue
        prefix = module_path(src, os.path.join(dirpath, "mod.rs"))
        children = {f[:-3] for f in filenames if f.endswith(".rs") and f != "mod.rs"} | set(dirnames)
        folders[tuple(prefix)] = children
    graphs = {p: {c: set() for c in kids | {"mod"}} for p, kids in folders.items()}
    for path in rust_files(src):
        if os.sep + "bin" + os.sep in path:
            continue
        for here, target in file_references(src, path):
            for prefix, kids in folders.items():
                n = len(prefix)
                if list(here[:n]) != list(prefix) or list(target[:n]) != list(prefix):
                    continue
                source = here[n] if len(here) > n and here[n] in kids else "mod"
                dest = target[n] if len(target) > n and target[n] in kids else "mod"
                if source != dest:
                    graphs[prefix][source].add(dest)
    found = []
    for prefix, graph in sorted(graphs.items()):
        for comp in cycles(graph):
            found.append("/".join(prefix) + ": " + " <-> ".join(comp))
    return found, graphs


def cycles(graph):
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def long_functions(top):
    for path in rust_files(top):
        lines = strip_code(open(path, encoding="utf-8").read()).split("\n")
        for i, line in enumerate(lines):
            m = FN.match(line)
            if not m:
                continue
            depth, opened = 0, False
            for j in range(i, len(lines)):
                for ch in lines[j]:
                    if ch == "{":
                        depth += 1
                        opened = True
                    elif ch == "}":
                        depth -= 1
                if opened and depth <= 0:
                    break
                if not opened and lines[j].rstrip().endswith(";"):
                    break
            if opened:
                yield j - i + 1, os.path.relpath(path, ROOT), i + 1, m.group(7)


def main():
    verbose = "--verbose" in sys.argv
    failed = False
    for crate in CRATES:
        graph = module_graph(os.path.join(ROOT, crate, "src"))
        found = cycles(graph)
        if verbose:
            for node in sorted(graph):
                print(f"  {crate}: {node} -> {', '.join(sorted(graph[node])) or '-'}")
        print(f"{crate}: {len(graph)} modules, " + (f"CYCLES {found}" if found else "no module cycle"))
        failed |= bool(found)
        inner, graphs = folder_cycles(os.path.join(ROOT, crate, "src"))
        if verbose:
            for prefix, graph in sorted(graphs.items()):
                for node in sorted(graph):
                    print(f"  {crate}/{'/'.join(prefix)}: {node} -> {', '.join(sorted(graph[node])) or '-'}")
        for c in inner:
            print(f"{crate}: cycle between files of {c}")
        failed |= bool(inner)
    longest = []
    for top in LONG_FUNCTION_DIRS:
        longest.extend(long_functions(os.path.join(ROOT, top)))
    longest.sort(reverse=True)
    over = [f for f in longest if f[0] > MAX_LINES]
    for n, path, line, name in over:
        print(f"function over {MAX_LINES} lines: {path}:{line} {name} ({n} lines)")
    if longest:
        n, path, line, name = longest[0]
        print(f"{'/'.join(LONG_FUNCTION_DIRS)}: longest function {name} ({path}:{line}), {n} lines")
    failed |= bool(over)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = len(f.read().splitlines())
    print(f"README.md: {readme} lines (at most {README_MAX_LINES})")
    if readme > README_MAX_LINES:
        print(f"README.md is {readme} lines, over {README_MAX_LINES}: move reference material to docs/ and link it")
        failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
