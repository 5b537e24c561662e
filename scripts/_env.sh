# Sourced by scripts/serve and scripts/test: create or reuse .venv and install callgate into it.
# Re-installs only when pyproject.toml changed since the last install (stamp file).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CALLGATE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "callgate needs Python 3.11 or newer on PATH" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtualenv $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.callgate-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)-${1:-run}"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing callgate and its dependencies into $VENV (log: $VENV/install.log)" >&2
  EXTRA=""; [ "${1:-run}" = "test" ] && EXTRA="[test]"
  # torch first, pinned: the CPU wheel (a looser requirement pulls a multi-GB CUDA build).
  if ! { "$VENV/bin/python" -m pip install -q --upgrade pip \
         && "$VENV/bin/python" -m pip install -q "torch==2.13.0" \
         && "$VENV/bin/python" -m pip install -q -e "$ROOT$EXTRA"; } >"$VENV/install.log" 2>&1; then
    cat "$VENV/install.log" >&2
    echo "installing callgate failed (see above)" >&2
    exit 1
  fi
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
