#!/usr/bin/env python3
"""No include runs back up: every header under include/expert_cache/ includes only headers of its own
folder or of a lower layer. The layers are read from docs/design.md (the ```layers block: one folder
per line, its rank, its job), so the map a reader sees is the one this test checks.

usage: check_layers.py <repository root>
Exit 0 when every include goes down or sideways within a folder; 1 with one line per violation."""
import pathlib
import re
import sys

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]expert_cache/([^>"]+)[>"]', re.M)


def read_layers(design_md: pathlib.Path) -> dict[str, int]:
    text = design_md.read_text(encoding="utf-8")
    block = re.search(r"^```layers\n(.*?)^```", text, re.M | re.S)
    if not block:
        sys.exit(f"{design_md}: no ```layers block")
    layers = {}
    for line in block.group(1).splitlines():
        if not line.strip() or line[0].isspace():
            continue  # a continuation of the job's description
        fields = line.split()
        folder, rank = fields[0].rstrip("/"), fields[1]
        if not rank.isdigit():
            sys.exit(f"{design_md}: layer line without a rank: {line!r}")
        layers[folder] = int(rank)
    return layers


def folder_of(relative: str) -> str:
    parts = relative.split("/")
    return "(root)" if len(parts) == 1 else parts[0]


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    layers = read_layers(root / "docs" / "design.md")
    include_root = root / "include" / "expert_cache"
    problems = []
    present = set()
    for header in sorted(p for p in include_root.rglob("*") if p.is_file()):
        relative = header.relative_to(include_root).as_posix()
        own = folder_of(relative)
        present.add(own)
        if own not in layers:
            problems.append(f"{relative}: folder {own!r} is not in design.md's layer list")
            continue
        for target in INCLUDE_RE.findall(header.read_text(encoding="utf-8")):
            other = folder_of(target)
            if other == own:
                continue
            if other not in layers:
                problems.append(f"{relative} includes {target}: folder {other!r} is not in the layer list")
            elif layers[other] >= layers[own]:
                problems.append(f"{relative} (layer {layers[own]}, {own}) includes {target} "
                                f"(layer {layers[other]}, {other}): an include may only go down")
    for folder in sorted(set(layers) - present):
        problems.append(f"design.md lists {folder!r}, which holds no header")
    for p in problems:
        print(p)
    print(f"{len(present)} folders checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
