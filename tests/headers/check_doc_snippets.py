#!/usr/bin/env python3
"""The docs' code examples are the compiled ones: every fenced code block in README.md and
docs/*.md that an HTML comment `<!-- snippet: PATH NAME -->` precedes must equal the region of
PATH (relative to the repository root) between its two `// [NAME]` marker lines, both with their
common indentation stripped. The files come from examples/, which the build compiles, so a block
that drifts from the library fails here instead of misleading a reader.

Usage: check_doc_snippets.py REPO_ROOT. Exits 1 naming the doc, the file and the snippet of every
mismatch (with a diff), missing file or region, or marker without a block, and when no doc has a
marked block at all.
"""
import difflib
import pathlib
import re
import sys

MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(\S+)\s+(\S+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```")


def dedent(lines):
    """The lines without their common leading whitespace (blank lines do not count)."""
    indents = [len(l) - len(l.lstrip()) for l in lines if l.strip()]
    cut = min(indents) if indents else 0
    return [l[cut:] if l.strip() else "" for l in lines]


def region(path, name):
    """The lines between the two `// [name]` markers of `path`, or an error text."""
    text = path.read_text(encoding="utf-8").splitlines()
    marks = [i for i, l in enumerate(text) if l.strip() == f"// [{name}]"]
    if len(marks) != 2:
        return None, f"{len(marks)} '// [{name}]' marker lines (need 2)"
    return dedent(text[marks[0] + 1 : marks[1]]), None


def blocks(doc):
    """(line number, path, name, block lines) for every marked block of one doc."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not FENCE.match(lines[j]):
            yield i + 1, m.group(1), m.group(2), None
            i = j
            continue
        k = j + 1
        while k < len(lines) and not FENCE.match(lines[k]):
            k += 1
        yield i + 1, m.group(1), m.group(2), dedent(lines[j + 1 : k])
        i = k + 1


def main():
    if len(sys.argv) != 2:
        print("usage: check_doc_snippets.py REPO_ROOT", file=sys.stderr)
        return 2
    root = pathlib.Path(sys.argv[1])
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    problems = 0
    checked = 0
    for doc in docs:
        if not doc.exists():
            continue
        rel = doc.relative_to(root)
        for line, path, name, block in blocks(doc):
            where = f"{rel}:{line}: snippet {name} of {path}"
            if block is None:
                print(f"{where}: no code block follows the marker")
                problems += 1
                continue
            source = root / path
            if not source.is_file():
                print(f"{where}: {path} does not exist")
                problems += 1
                continue
            expected, error = region(source, name)
            if error:
                print(f"{where}: {error}")
                problems += 1
                continue
            checked += 1
            if block != expected:
                print(f"{where}: the block differs from the marked region")
                diff = difflib.unified_diff(expected, block, f"{path} [{name}]", f"{rel} block", lineterm="")
                for d in diff:
                    print("    " + d)
                problems += 1
    if checked == 0 and problems == 0:
        print("no marked snippet found in README.md or docs/*.md")
        return 1
    print(f"{checked} snippets checked, {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
