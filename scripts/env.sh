# Sourced by scripts/run.sh and scripts/test.sh: create or reuse ./.venv with the project
# installed (editable, with the test extra). torch==2.13.0 comes from the machine's local
# wheel; the rest from the package registry. Reinstalls when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.installed-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  # each step says what it does as it starts (stderr): the first run takes about a minute
  echo "setting up $VENV (first run, or pyproject.toml changed): about a minute" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  echo "  installing torch 2.13.0 ..." >&2
  # pip compiles each file's bytecode one after another; compileall does it on every core
  # (half the set-up on 2 cores). A file some package ships that does not compile is
  # skipped, as pip skips it.
  "$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0" >&2
  echo "  installing layer_boundary and its test extra (transformers, peft, triton, ruff) ..." >&2
  # setuptools' editable-install notice (a boxed warning about folders named like the
  # package) is left out; pip's own failure still ends the set-up
  "$VENV/bin/python" -m pip install -q --no-compile -e "$ROOT[test]" 2> >(
    grep -v -e "^ *!!$" -e "^\s*$" -e "\*\*\*\*" -e "BuildBackendWarning" \
      -e "Please be careful with folders" -e "name as your package" -e "WheelFile(" >&2)
  echo "  compiling bytecode ..." >&2
  "$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" > /dev/null 2>&1 || true
  echo "  done" >&2
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
