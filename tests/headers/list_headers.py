#!/usr/bin/env python3
"""Lists the public headers under include/expert_cache/ by the compiler they need.

  list_headers.py INCLUDE_DIR TIER           one header per line (paths relative to INCLUDE_DIR)
  list_headers.py INCLUDE_DIR --check LIST   exit 1 when LIST (the tiers' lists as configured,
                                             comma separated) no longer matches the tree

Tiers: 'cuda' = *.cuh (nvcc); 'cudart' = *.hpp whose name starts with 'cuda' (the host
compiler plus CUDA's include directory: runtime/cuda_*.hpp, cache/cuda_presets.hpp, cuda.hpp);
'host' = every other *.hpp (the host compiler alone). tests/headers/meson.build builds one
translation unit per header from these lists, so a header is checked as soon as it exists
(after a reconfigure, which the --check test asks for)."""
import pathlib
import sys


def tier_of(path: pathlib.PurePosixPath) -> str | None:
    if path.suffix == ".cuh":
        return "cuda"
    if path.suffix == ".hpp":
        return "cudart" if path.name.startswith("cuda") else "host"
    return None


def headers(include_dir: str) -> dict[str, list[str]]:
    root = pathlib.Path(include_dir)
    out: dict[str, list[str]] = {"host": [], "cudart": [], "cuda": []}
    for p in sorted(root.glob("expert_cache/**/*")):
        rel = pathlib.PurePosixPath(p.relative_to(root).as_posix())
        tier = tier_of(rel)
        if p.is_file() and tier is not None:
            out[tier].append(str(rel))
    return out


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[2] == "--check":
        configured = sorted(h for h in sys.argv[3].split(",") if h)
        now = sorted(h for tier in headers(sys.argv[1]).values() for h in tier)
        if configured != now:
            added = sorted(set(now) - set(configured))
            removed = sorted(set(configured) - set(now))
            print(f"header list is stale (added {added}, removed {removed}): re-run meson setup --reconfigure")
            return 1
        print(f"{len(now)} headers, list current")
        return 0
    if len(sys.argv) != 3 or sys.argv[2] not in ("host", "cudart", "cuda"):
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(headers(sys.argv[1])[sys.argv[2]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
