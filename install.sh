#!/usr/bin/env bash
# Install qeval into a virtual environment, with llama.cpp compiled for the CPU (and GPU) it runs on.
#
#   ./install.sh                          # .venv, extras "demo"
#   ./install.sh --extras test,demo,ray   # what the test suite needs
#   ./install.sh --gpu cuda               # or metal, vulkan, hip
#   ./install.sh --rebuild                # rebuild llama-cpp-python even if its flags did not change
#
# The build flags come from qeval/engine/buildflags.py (CPU features read from /proc/cpuinfo; extra
# CMAKE_ARGS from the environment are appended and win). llama-cpp-python is rebuilt only when
# those flags change, and then always from source: pip's wheel cache ignores CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv extras=demo gpu="${QEVAL_GPU:-}" rebuild=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --gpu) gpu="$2"; shift 2 ;;
    --rebuild) rebuild=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip

cmake_args="$("$py" qeval/engine/buildflags.py ${gpu:+--gpu "$gpu"}) ${CMAKE_ARGS:-}"
llama_pkg="$("$py" qeval/engine/buildflags.py --package)"
stamp="$venv/.qeval-llama-cpp-build"
if [ "$rebuild" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$llama_pkg $cmake_args" ] \
   || ! "$py" -c "import llama_cpp" 2>/dev/null; then
  echo "install.sh: building $llama_pkg with CMAKE_ARGS=$cmake_args (a few minutes)"
  CMAKE_ARGS="$cmake_args" "$py" -m pip install --quiet --no-cache-dir --force-reinstall --no-deps "$llama_pkg"
  echo "$llama_pkg $cmake_args" > "$stamp"
fi

"$py" -m pip install --quiet -e ".[$extras]"
echo "install.sh: done. Activate with: . $venv/bin/activate"
