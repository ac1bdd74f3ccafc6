"""A stand-in for the C++ compiler, for the tests of how the CPU kernels are built (tests/test_cpu_kernel_build.py):
fast, and made to fail, hang or be slow on demand. Run as ``python compiler.py <the compiler's arguments>``.

FAKE_COMPILER_MODE   copy (default): ``-c`` writes an object file, a link copies FAKE_COMPILER_LIBRARY (a real build)
                     to its ``-o``; fail: says "error: boom" the way a compiler does and exits 1; hang: sleeps
FAKE_COMPILER_LOG    a file each run appends its arguments to (one line)
FAKE_COMPILER_PIDS   a file each compile appends its process id to (before it sleeps)
FAKE_COMPILER_DELAY  seconds each compile or link takes
"""

import os
import shutil
import sys
import time

arguments = sys.argv[1:]
if arguments == ["--version"]:
    print("fake compiler 1.0")
    sys.exit(0)
if os.environ.get("FAKE_COMPILER_LOG"):
    with open(os.environ["FAKE_COMPILER_LOG"], "a") as log:
        log.write(" ".join(arguments) + "\n")
if os.environ.get("FAKE_COMPILER_PIDS"):
    with open(os.environ["FAKE_COMPILER_PIDS"], "a") as pids:
        pids.write(f"{os.getpid()}\n")
mode = os.environ.get("FAKE_COMPILER_MODE", "copy")
if mode == "hang":
    time.sleep(300)
time.sleep(float(os.environ.get("FAKE_COMPILER_DELAY", "0")))
if mode == "fail":
    print("In file included from kernels/lanes.h:1:", file=sys.stderr)
    print("kernels/rms_norm.cpp:3:1: error: boom", file=sys.stderr)
    sys.exit(1)
output = arguments[arguments.index("-o") + 1]
if "-shared" in arguments:
    shutil.copyfile(os.environ["FAKE_COMPILER_LIBRARY"], output)
else:
    with open(output, "wb") as built:
        built.write(b"object")
