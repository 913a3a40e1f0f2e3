"""Test configuration: fp32 CPU runs; k3jax is imported first so its XLA:CPU workaround applies.

`pytest -q` runs on two pytest-xdist workers (``-n 2 --dist loadgroup``, pyproject.toml; ``-n 0``
runs in this process). A test that uses a module- or session-scoped fixture of ours (a compiled
model, a trained run) joins the group of the tests sharing it -- its module, or the package whose
conftest defines the session fixture -- so each such fixture is built on one worker, once; the
other tests go to whichever worker is free.
"""
import os

import jax
import pytest

import k3jax  # noqa: F401  (sets XLA flags before JAX creates a backend)


WITHOUT_LLVM_OPTIMISATION = "--xla_backend_optimization_level=0"


def _without_llvm_optimisation(flags: str | None) -> str:
    return f"{flags or ''} {WITHOUT_LLVM_OPTIMISATION}".strip()


def environment_compiling_like_this_process() -> dict:
    """``os.environ`` with this process's compiler setting: for a subprocess whose results are
    compared bit for bit with this process's."""
    return {**os.environ, "XLA_FLAGS": _without_llvm_optimisation(os.environ.get("XLA_FLAGS"))}


def create_backend_without_llvm_optimisation() -> None:
    """Create this process's XLA:CPU backend with LLVM's optimisation off (``-O0``).

    The suite compiles hundreds of small programs and runs each for microseconds, so LLVM's
    optimisation passes are most of its time (about 40% of the CPU time of the attention tests)
    and none of its meaning: they change speed and last-bit roundings (e.g. of the random
    initialisation; XLA:CPU uses no fast-math), not what the tests check. The backend reads XLA_FLAGS once, when it is created; the variable is restored
    afterwards, so subprocesses (the trainer, eval and converter as users run them) compile as
    usual (`environment_compiling_like_this_process` for those compared bit for bit)."""
    flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = _without_llvm_optimisation(flags)
    try:
        jax.devices()
    finally:
        if flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = flags


create_backend_without_llvm_optimisation()


def shared_fixture_group(item) -> str | None:
    """The package (session-scoped fixtures) or module (module-scoped ones) whose shared fixtures
    ``item`` uses, the broader first; None when it uses only per-test fixtures of ours."""
    definitions = [definition for definitions in item._fixtureinfo.name2fixturedefs.values()
                   for definition in definitions if definition.baseid]   # baseid "": pytest's own
    for scope in ("session", "package", "module"):
        owners = sorted({definition.baseid for definition in definitions if definition.scope == scope})
        if owners:
            return owners[0] if scope != "module" else item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        group = shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
