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


@pytest.mark.parametrize("requested, micro_batch, cores, expected", [
    ("auto", 16, 2, 2), ("auto", 15, 2, 1), ("auto", 12, 8, 6), ("auto", 16, 1, 1), (3, 16, 2, 3)])
def test_cpu_device_count_is_the_most_cores_that_split_the_micro_batch(requested, micro_batch, cores, expected):
    from k3jax.host import cpu_device_count

    assert cpu_device_count(requested, micro_batch, cores) == expected


def test_mesh_cpu_devices_accepts_auto_or_a_positive_count():
    from k3jax.config import ConfigError, MeshConfig, load_config

    assert load_config("configs/tiny.yaml", ["mesh.cpu_devices=3"]).mesh.cpu_devices == 3
    assert MeshConfig().cpu_devices == 1     # measured best on the shared 2-core machine (bench.cpu_cores)
    assert load_config("configs/tiny.yaml", ["mesh.cpu_devices=auto"]).mesh.cpu_devices == "auto"
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match="cpu_devices"):
            load_config("configs/tiny.yaml", [f"mesh.cpu_devices={bad}"])


DEVICES_PROGRAM = textwrap.dedent("""
    import sys, jax
    from k3jax.config import load_config
    from k3jax.host import use_cpu_cores
    used = use_cpu_cores(load_config("configs/tiny.yaml", sys.argv[1:]))
    print(used, jax.device_count())
""")


NO_FLAGS = {"XLA_FLAGS": ""}


@pytest.mark.slow   # subprocesses: the device count is fixed when the backend starts
@pytest.mark.parametrize("overrides, environment, expected", [
    (["mesh.cpu_devices=3"], NO_FLAGS, "3 3"),                       # a count: that many devices
    (["mesh.cpu_devices=3", "mesh.data=1"], NO_FLAGS, "None 1"),     # a mesh the user sized: left alone
    (["mesh.cpu_devices=3"], {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, "None 2"),  # XLA_FLAGS wins
    (["mesh.cpu_devices=3"], {**NO_FLAGS, "JAX_NUM_CPU_DEVICES": "2"}, "None 2"),   # so does JAX's own setting
    (["mesh.cpu_devices=auto", "train.batch_size=15"], NO_FLAGS, "1 1")])   # nothing divides 15 but 1 (<= cores)
def test_use_cpu_cores_sets_the_device_count_before_the_backend_starts(overrides, environment, expected):
    import os

    env = {key: value for key, value in os.environ.items() if key != "JAX_NUM_CPU_DEVICES"}
    out = subprocess.run([sys.executable, "-c", DEVICES_PROGRAM, *overrides], capture_output=True, text=True,
                         env={**env, **environment}, check=True).stdout.split("\n")[-2]
    assert out == expected
