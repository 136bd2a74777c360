"""Shared harness of the CLI end-to-end tests (test_replay_cli.py, test_bench_cli.py): runs the
program under test, writes inputs into a fresh temporary directory, and stops at the first
failed expectation with its context."""
import os
import subprocess
import sys
import tempfile

EXE = None      # the program under test (argv[1])
TMP = None      # the temporary directory of this run
TIMEOUT = 120   # seconds per run of EXE


def run(*args, stdin=None):
    p = subprocess.run([EXE, *args], input=stdin, capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode, p.stdout, p.stderr


def write(name, text):
    path = os.path.join(TMP, name)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return path


def expect(cond, what, *context):
    if not cond:
        print("FAILED:", what)
        for c in context:
            print("----\n" + str(c))
        sys.exit(1)


# A rejected command line: exit code 2, `needle` on stderr, no crash text. Returns (rc, out, err).
def expect_usage_error(args, needle, stdin=None):
    rc, out, err = run(*args, stdin=stdin)
    expect(rc == 2, f"exit code 2 for {args}, got {rc}", out, err)
    expect(needle in err, f"stderr of {args} mentions {needle!r}", err)
    expect("internal" not in err and "Traceback" not in err, f"no crash text for {args}", err)
    return rc, out, err


# usage: SCRIPT PATH_TO_EXE CASE|all. Runs the named case (or every one) in a fresh TMP.
def main(cases, usage, timeout):
    global EXE, TMP, TIMEOUT
    if len(sys.argv) != 3 or (sys.argv[2] not in cases and sys.argv[2] != "all"):
        print(usage)
        return 2
    EXE = os.path.abspath(sys.argv[1])
    TIMEOUT = timeout
    with tempfile.TemporaryDirectory() as tmp:
        TMP = tmp
        for name, fn in cases.items():
            if sys.argv[2] in (name, "all"):
                fn()
                print("ok", name)
    return 0
