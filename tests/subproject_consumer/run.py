#!/usr/bin/env python3
"""Builds tests/subproject_consumer as a project of its own, with the repository as its
subproject 'expert_cache', and checks subproject hygiene:
  * the consumer builds and runs through both dependencies (host; CUDA tier when enabled);
  * the subproject builds nothing of its own: no test, benchmark, tool or example targets; its
    only targets are the compiled mode's libraries (expert_cache_any, expert_cache_any_cuda), not
    built by default, built here because consumer_any asks for expert_cache_any.

  run.py MESON SOURCE_ROOT CUDA   (CUDA: 'enabled' or 'disabled', as the parent build)
Runs in a temporary directory; NVCC from the environment picks the CUDA compiler."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile


def run(cmd, cwd=None):
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        print(done.stdout)
        raise SystemExit(f"FAIL: {' '.join(cmd)} exited {done.returncode}")
    return done.stdout


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[3] not in ("enabled", "disabled"):
        print(__doc__, file=sys.stderr)
        return 2
    meson, root, cuda = sys.argv[1], pathlib.Path(sys.argv[2]).resolve(), sys.argv[3]
    here = root / "tests" / "subproject_consumer"
    with tempfile.TemporaryDirectory(prefix="expert_cache_consumer_") as tmp:
        src = pathlib.Path(tmp) / "consumer"
        src.mkdir()
        for name in ("meson.build", "host.cpp", "cuda.cpp", "any.cpp"):
            shutil.copy(here / name, src / name)
        (src / "subprojects").mkdir()
        os.symlink(root, src / "subprojects" / "expert_cache")
        build = pathlib.Path(tmp) / "build"
        # buildtype plain: no debug info, which only made this hygiene check slower.
        setup = run([meson, "setup", str(build), str(src), "-Dbuildtype=plain", f"-Dexpert_cache:cuda={cuda}"])
        run([meson, "compile", "-C", str(build)])
        targets = json.loads(run([meson, "introspect", "--targets", str(build)]))
        names = sorted(t["name"] for t in targets)
        print("targets:", names)
        compiled_mode = {"expert_cache_any", "expert_cache_any_cuda"}
        own = sorted(t["name"] for t in targets
                     if t.get("subproject") and (t["name"] not in compiled_mode or t.get("build_by_default")))
        if own:
            raise SystemExit(f"FAIL: the expert_cache subproject built targets of its own: {own}")
        want = ["consumer_any", "consumer_host"] + (["consumer_cuda"] if cuda == "enabled" else [])
        names = sorted(n for n in names if n not in compiled_mode)
        if names != sorted(want):
            raise SystemExit(f"FAIL: expected exactly the consumer targets {want}, got {names}")
        if "doctest" in setup or "WARNING: doctest" in setup:
            raise SystemExit("FAIL: the subproject looked for doctest although no tests were asked for")
        for exe in want:
            run([str(build / exe)])
    print(f"ok: consumer built and ran {want}; the subproject built nothing but the compiled-mode library asked for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
