"""Test configuration: fp32 CPU runs; k3jax is imported first so its XLA:CPU workaround applies.

`pytest -q` runs on two pytest-xdist workers (``-n 2 --dist loadgroup``, pyproject.toml; ``-n 0``
runs in this process). A test that uses a module- or session-scoped fixture of ours (a compiled
model, a trained run) joins the group of its module, so a module fixture is built once and a
session fixture once per worker that needs it; the other tests go to whichever worker is free. The
costliest groups are collected first (`costliest_first`).
"""
import collections
import json
import os
import pathlib

import jax
import pytest

import k3jax  # noqa: F401  (sets XLA flags before JAX creates a backend)


def jaxlib_minor() -> tuple[int, int]:
    import jaxlib.version
    return tuple(int(part) for part in jaxlib.version.__version__.split(".")[:2])


# XLA:CPU flags of this suite's compilations. LLVM's optimisation off (``-O0``), and, on the
# jaxlib they were measured on (0.10: XLA aborts on a flag it does not know), XLA:CPU's older
# loop emitters for fusions instead of its fusion emitters (18% less backend compile time for the
# micro K3's train step on top of ``-O0``, the same losses).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                  *(("--xla_cpu_use_fusion_emitters=false",) if jaxlib_minor() == (0, 10) else ()))


def run_on_the_cpu() -> None:
    """The suite runs on the CPU, this process and the subprocesses its tests start
    (``JAX_PLATFORMS=cpu`` unless set): with the ``tpu`` extra installed, JAX would otherwise start
    by looking for a TPU (slower, and five lines of warnings on stderr, which the one-line error
    tests read). Compile-only TPU devices (`k3jax.tpu`, tests/test_tpu.py) need no TPU platform."""
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")      # this process imported JAX before reading it


def compile_for_tests() -> None:
    """Compile this process's programs, and its subprocesses', with `TEST_XLA_FLAGS`.

    The suite compiles hundreds of small programs and runs each for microseconds or milliseconds,
    so compilation is most of its time: LLVM's optimisation passes alone are about 40% of the CPU
    time of the attention tests and 20% of the trainer subprocess tests'. The flags change speed
    and last-bit roundings (XLA:CPU uses no fast-math), not what the tests check. XLA reads
    XLA_FLAGS when a process creates its backend, so setting the variable here, before JAX does,
    covers this process and every subprocess a test starts; tests that compare subprocesses with
    this process therefore compare like with like. `environment_compiling_as_users_do` is for the
    few checks of a last-bit property of the default compilation."""
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()
    jax.devices()


def environment_compiling_as_users_do() -> dict:
    """``os.environ`` without this suite's `TEST_XLA_FLAGS`: for a subprocess checking a bit-exact
    property of the compilation users get (e.g. that sharded initialisation equals eager
    initialisation)."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in TEST_XLA_FLAGS)
    return {**os.environ, "XLA_FLAGS": flags}


run_on_the_cpu()
compile_for_tests()

# Every compiled XLA:CPU program keeps a few memory mappings (its code and constants), and Linux
# allows a process vm.max_map_count of them (65530 by default). A pytest-xdist worker lives through
# hundreds of tests and thousands of programs; past the limit, mmap fails inside XLA or LLVM and the
# worker dies (a segmentation fault in the compilation cache's write, an abort in a compile: seen in
# `.ci/run`'s slow set once the speculative decoding tests' programs were added, with 1.5-3 GB of 24
# in use; one process running tests/sessions' slow tests held 4K, 10K, 18K, then 34K mappings after
# test_speculate). So after a module, a process holding more than MAP_BUDGET mappings drops its
# compiled programs (`jax.clear_caches`); later tests compile again (the persistent cache makes that
# a load).
MAP_BUDGET = 30_000


def memory_mappings() -> int:
    with open(f"/proc/{os.getpid()}/maps") as maps:
        return sum(1 for _ in maps)


def pytest_runtest_teardown(item, nextitem):
    last_of_its_module = nextitem is None or nextitem.module is not item.module
    if last_of_its_module and os.path.exists("/proc/self/maps") and memory_mappings() > MAP_BUDGET:
        jax.clear_caches()


def shared_fixture_group(item) -> str | None:
    """``item``'s module when it uses a shared (module-, package- or session-scoped) fixture of
    ours; None when it uses only per-test fixtures. A module's tests then share its fixtures on one
    worker, and a session fixture is built once by each worker that runs a module using it (at
    most twice): that costs less than keeping a whole package on one worker (tests/serve's modules
    share one server fixture and are the longest group of the fast set)."""
    definitions = [definition for definitions in item._fixtureinfo.name2fixturedefs.values()
                   for definition in definitions if definition.baseid]   # baseid "": pytest's own
    if any(definition.scope in ("session", "package", "module") for definition in definitions):
        return item.nodeid.split("::")[0]
    return None


# Seconds each test took in a `.ci/run` (call + setup + teardown; `python -m tests.durations LOG`
# rewrites it from a run's ``--durations`` lists), to start the costliest work first.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
UNKNOWN_SECONDS = 1.0   # a test not in DURATIONS: the fast ones are left out of it


def costliest_first(items: list, scopes: list) -> list:
    """``items`` reordered so that their scopes (``scopes[i]``: the xdist group of ``items[i]``, or
    its own node id) come in decreasing order of their recorded seconds, each scope's items in
    their collected order. pytest-xdist's loadgroup scheduler hands scopes to free workers in
    collection order (``--no-loadscope-reorder``, pyproject.toml; by default it orders them by
    their number of tests), so this is longest-processing-time-first scheduling: the long groups
    and tests start at once instead of making the run's tail."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    cost, first, members = collections.Counter(), {}, collections.defaultdict(list)
    for index, (item, scope) in enumerate(zip(items, scopes)):
        cost[scope] += seconds.get(item.nodeid, UNKNOWN_SECONDS)
        first.setdefault(scope, index)
        members[scope].append(item)
    return [item for scope in sorted(members, key=lambda s: (-cost[s], first[s])) for item in members[scope]]


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    scopes = []
    for item in items:
        group = shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        scopes.append(item.nodeid if group is None else group)
    items[:] = costliest_first(items, scopes)
