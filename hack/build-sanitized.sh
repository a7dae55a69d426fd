#!/usr/bin/env bash
# The PS's C kernels (pyproject.toml's ext-module tfps.runtime._rows: runtime/*.c) built with
# sanitizers, every report fatal, into a folder of their own, for the fuzz targets
# (tests/fuzz/run.py). Prints the module's path.
#
#   hack/build-sanitized.sh [asan|trap]
#
# asan (default, .tfps/sanitized/asan): AddressSanitizer and UndefinedBehaviorSanitizer, GCC's (no
#   clang needed). Python itself is not built with them, so the runner starts it with GCC's libasan
#   preloaded (`gcc -print-file-name=libasan.so`).
# trap (.tfps/sanitized/trap): UndefinedBehaviorSanitizer alone, each check a trap instruction, no
#   runtime library: for the coverage-guided runs, which libasan's preload would blind (its own
#   coverage callbacks take the place of atheris's libFuzzer's).
# No -fwrapv (Python's own CFLAGS have it): a signed overflow is reported, not wrapped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mode=${1:-asan}
case "$mode" in
  asan) sanitize=(-fsanitize=address,undefined -fno-sanitize-recover=all) ;;
  trap) sanitize=(-fsanitize=undefined -fsanitize-undefined-trap-on-error) ;;
  *) echo "usage: $0 [asan|trap]" >&2; exit 2 ;;
esac
out=${TFPS_SANITIZED_DIR:-.tfps/sanitized}/$mode
mkdir -p "$out"
include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
mapfile -t sources < <("$PY" -c '
import tomllib
modules = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["ext-modules"]
print(*next(m for m in modules if m["name"] == "tfps.runtime._rows")["sources"], sep="\n")')
so="$out/_rows$suffix"
${CC:-gcc} -shared -fPIC -O1 -g -fno-omit-frame-pointer "${sanitize[@]}" \
  -ffp-contract=off -fno-math-errno -Wall -Wextra -Werror \
  -I"$include" "${sources[@]}" -o "$so.tmp"
mv "$so.tmp" "$so"
echo "$so"
