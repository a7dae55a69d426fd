"""The PS's C update kernels compile to SIMD code with the flags the package builds them with.

A loop the compiler leaves scalar still gives the right numbers, only several times slower, so
no other test notices (the dense Adam loop was scalar for several releases: eight arrays are more
than GCC checks for overlap at run time). This asks GCC itself, with the flags of pyproject.toml's
ext-module, which loops it vectorised."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

import pytest
from support import REPO

SOURCE = REPO / "runtime" / "_rows.c"
OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad")
# Each optimizer's update of one row (a table's touched rows) and its dense loop (a whole variable).
KERNELS = [f"{name}_{kind}" for name in OPTIMIZERS for kind in ("row", "loop")]


def ext_module() -> dict:
    with open(REPO / "pyproject.toml", "rb") as fh:
        modules = tomllib.load(fh)["tool"]["setuptools"]["ext-modules"]
    (rows,) = [m for m in modules if m["name"] == "tfps.runtime._rows"]
    return rows


def compile_flags() -> list[str]:
    return ext_module()["extra-compile-args"]


def loop_lines(source: str, function: str) -> list[int]:
    """The line numbers of the `for` loops in the body of `function` (a static C function)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"static .*\b{function}\(", line))
    found = []
    for i in range(start, len(lines)):
        if lines[i].startswith("}"):
            return found
        if "for (" in lines[i]:
            found.append(i + 1)
    raise AssertionError(f"{function} has no end")


def vectorised_lines(source: Path, out: Path, *link: str) -> set[int]:
    """The lines of `source` whose loops GCC reports vectorised, built with pyproject's flags."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc: the kernels are built in the PS image's build stage")
    cmd = [gcc, *compile_flags(), *link, "-fopt-info-vec-optimized", str(source), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    pattern = rf"{re.escape(source.name)}:(\d+):\d+: optimized: loop vectorized"
    return {int(m.group(1)) for m in re.finditer(pattern, result.stderr)}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[set[int], Path]:
    """The lines GCC vectorised, and the module it built."""
    out = tmp_path_factory.mktemp("kernels") / "_rows.so"
    others = [str(REPO / s) for s in ext_module()["sources"] if REPO / s != SOURCE]  # the module's other half
    return vectorised_lines(SOURCE, out, "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", *others), out


@pytest.fixture(scope="module")
def vectorised(built) -> set[int]:
    return built[0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_update_kernel_is_vectorised(kernel, vectorised):
    lines = loop_lines(SOURCE.read_text(), kernel)
    assert lines, f"{kernel} has no loop"
    scalar = [n for n in lines if n not in vectorised]
    assert not scalar, f"{kernel}: the loop at line(s) {scalar} of runtime/_rows.c compiles to scalar code"


def test_the_check_can_fail(tmp_path):
    """The same question asked of a loop GCC cannot vectorise (each float depends on the one before),
    beside one it can."""
    src = tmp_path / "loops.c"
    src.write_text(
        "void scan(float *x, long n) {\n    for (long j = 1; j < n; j++) x[j] += x[j - 1] * 0.5f;\n}\n"
        "void scale(float *restrict x, long n) {\n    for (long j = 0; j < n; j++) x[j] *= 0.5f;\n}\n"
    )
    assert vectorised_lines(src, tmp_path / "loops.o", "-c") == {5}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 builds are x86-64's")
def test_the_float_loops_have_an_avx2_build(built):
    """Each update (rows and dense), the checks, the bfloat16 casts and the worker's row sum are
    built for AVX2 beside the baseline, the loader picking one per CPU: a build that lost the
    attribute (a compiler without target_clones) would still be right, and slower."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    symbols = subprocess.run([nm, str(built[1])], capture_output=True, text=True, check=True).stdout
    functions = [f"{name}_{kind}" for name in OPTIMIZERS for kind in ("rows", "loop")]
    functions += ["finite_floats", "narrow_loop", "widen_loop", "sum_rows"]
    missing = [
        f
        for f in functions
        if not re.search(rf"\b{f}\.avx2\b", symbols) or not re.search(rf"\b{f}\.default\b", symbols)
    ]
    assert not missing, f"built without their AVX2 and baseline versions: {missing}"
