#!/usr/bin/env python3
"""Every public host header, included alone under C++17, stops with base/version.hpp's #error
("expert_cache needs C++20") as its first error, not with pages of concept errors.

  check_std_guard.py INCLUDE_DIR HEADER... -- CXX [ARGS...]   (CXX: the compiler command)
Each header is compiled with CXX -std=c++17 -fsyntax-only -Wfatal-errors (stops at the first
error), so the check costs little per header."""
import subprocess
import sys

WANT = "expert_cache needs C++20"


def main() -> int:
    if "--" not in sys.argv or len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    cut = sys.argv.index("--")
    include_dir, headers, cxx = sys.argv[1], sys.argv[2:cut], sys.argv[cut + 1:]
    bad = []
    for h in headers:
        done = subprocess.run([*cxx, "-std=c++17", "-fsyntax-only", "-Wfatal-errors", "-I", include_dir, "-x", "c++", "-"],
                              input=f'#include "{h}"\n', stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first_error = next((line for line in done.stdout.splitlines() if "error" in line), "")
        if done.returncode == 0 or WANT not in first_error:
            bad.append(f"{h}: exit {done.returncode}, first error: {first_error or '(none)'}")
    for line in bad:
        print("FAIL:", line)
    # And under C++20 base/version.hpp is silent.
    ok20 = subprocess.run([*cxx, "-std=c++20", "-fsyntax-only", "-I", include_dir, "-x", "c++", "-"],
                          input='#include "expert_cache/base/version.hpp"\n', stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if ok20.returncode != 0:
        print("FAIL: base/version.hpp does not compile under C++20:", ok20.stdout)
        return 1
    print(f"{len(headers) - len(bad)}/{len(headers)} headers stop with '{WANT}' under C++17")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
