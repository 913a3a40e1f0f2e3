"""``python -m tests.sharding.programs.python_stdout MODULE ARGS...`` runs ``python -m MODULE ARGS...``
with only what Python writes on stdout: file descriptor 1, where native libraries write (Gloo, XLA:CPU's
collectives library, prints its connection lines there from several threads, interleaved), is pointed
at stderr, and ``sys.stdout`` at a copy of the original descriptor."""
import os
import runpy
import sys


def main() -> None:
    module, *arguments = sys.argv[1:]
    python_stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(python_stdout, "w", buffering=1)
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
