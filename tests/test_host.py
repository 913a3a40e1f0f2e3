"""keep_freed_memory: large blocks come from the heap and stay there after free, so XLA:CPU's
next call reuses the pages of the last one (glibc's mallinfo2 tells where memory went)."""
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from k3jax.host import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
    size = 64 * 2**20
    block = libc.malloc(size)
    mapped = libc.mallinfo2().hblkhd        # bytes in mmap'd blocks while the block is live
    libc.free(ctypes.c_void_p(block))
    kept = libc.mallinfo2().fordblks        # free bytes the heap keeps after free
    print(tuned, mapped >= size, kept >= size)
""")


@pytest.mark.slow   # subprocesses
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_large_blocks_come_from_the_heap_and_stay_after_free():
    def run(mode):
        return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                              check=True).stdout.split()

    assert run("default") == ["None", "True", "False"]   # glibc's default: mmap'd, returned on free
    assert run("tuned") == ["True", "False", "True"]     # tuned: from the heap, kept for reuse
