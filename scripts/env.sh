# Sourced by scripts/run.sh and scripts/test.sh: create or reuse ./.venv with the project
# installed (editable, with the test extra). torch==2.13.0 comes from the machine's local
# wheel; the rest from the package registry. Reinstalls when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.installed-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
