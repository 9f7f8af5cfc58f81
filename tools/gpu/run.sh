#!/usr/bin/env bash
# Build llama-cpp-python (and llama-perplexity + llama-bench from the same tree) from the kit, install qeval,
# run the GPU checks, and write every result into one folder (tools/gpu/README.md).
#
#   tools/gpu/run.sh [--cpu] [--out DIR] [--jobs N] [--build-only] [--arch 90]
#
#   --cpu         the CPU variant (-ngl 0), to test the kit where no GPU is lent; default: CUDA, -ngl 99
#   --out DIR     where results go (default .gpukit/out-<variant>); on the device machine summary.json, run.log and
#                 build.json are also kept in $OUT as they are written (it brings back 8 files, 2 folders deep)
#   --jobs N      build parallelism (default: all cores)
#   --build-only  stop after the build and the install
#   --arch A      CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200)
#   -- ARGS       passed to tools/gpu/checks.py (e.g. -- --chunks 2 --rounds 1)
#
# Offline: everything comes from .gpukit/kit (assemble.py). The build folder .gpukit/work/build-<variant> is kept,
# so a rerun on the same machine rebuilds nothing. Python: $PYTHON, else python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD kit=$PWD/.gpukit/kit work=$PWD/.gpukit/work
variant=cuda out="" mirror="${OUT:-}" jobs="$(nproc)" build_only=0 arch=90
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) variant=cpu; shift ;;
    --out) out="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --arch) arch="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
out="$(mkdir -p "${out:-$work/../out-$variant}" && cd "${out:-$work/../out-$variant}" && pwd)"
py="${PYTHON:-python3}"
site=$work/site-$variant build=$work/build-$variant
mkdir -p "$site" "$work"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { echo "run.sh: $*" | tee -a "$out/run.log" ${mirror:+"$mirror/run.log"} >&2; }
stamp() { date +%s.%N; }
t_start=$(stamp)

# 1. the carried wheels, each only where this Python does not meet its requirement (the machine's own versions win)
missing="$("$py" tools/gpu/missing_wheels.py "$kit/wheels")"
if [ -n "$missing" ]; then
  log "installing $(for w in $missing; do basename "$w"; done | tr '\n' ' ')"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" $missing
fi

# 2. llama-cpp-python from the trimmed sdist; the tools come from the same build folder
src=$work/src
if [ ! -f "$src/pyproject.toml" ]; then
  mkdir -p "$src" && tar xzf "$kit"/src/llama_cpp_python-*.tar.gz -C "$src" --strip-components=1
fi
cmake_args="$("$py" qeval/engine/buildflags.py $([ "$variant" = cuda ] && echo --gpu cuda))"
cmake_args+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
cmake_args+=" -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF"
if [ "$variant" = cuda ]; then
  # one architecture, and flash attention compiled for the f16/q4_0/q8_0 caches only: the build's cost
  cmake_args+=" -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_CUDA_FA_ALL_QUANTS=OFF"
fi
log "building llama-cpp-python ($variant, -j$jobs): $cmake_args"
t_build=$(stamp)
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" \
  -C build-dir="$build" "$src" 2>&1 | tail -n 30 | tee -a "$out/run.log" >&2
build_s=$("$py" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$t_build" "$(stamp)")
log "built in $build_s s"
bindir="$(dirname "$(find "$build" -name llama-perplexity -type f -perm -u+x | head -n 1)")"
[ -x "$bindir/llama-perplexity" ] && [ -x "$bindir/llama-bench" ] || { log "llama-perplexity/llama-bench not built"; exit 1; }

# 3. qeval from this checkout, without its dependencies (they are the machine's or the wheels above)
"$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" "$repo" \
  2>&1 | tail -n 5 >&2
(cd / && "$py" -c "import llama_cpp, qeval; print('run.sh: llama_cpp', llama_cpp.__version__, 'from',
  llama_cpp.__file__, '; qeval from', qeval.__file__)") | tee -a "$out/run.log" >&2
echo "{\"variant\": \"$variant\", \"jobs\": $jobs, \"build_seconds\": $build_s, \"cmake_args\": \"$cmake_args\"}" \
  > "$out/build.json"
[ -n "$mirror" ] && cp "$out/build.json" "$mirror/"
[ "$build_only" = 1 ] && exit 0

# 4. a build whose libraries each carry their own C++ runtime (the H200 image's compiler links libstdc++ statically)
#    crashes as a model loads in Python (docs/gpu.md): load the system's runtime first, measured to cure it
if (cd / && "$py" -c "import sys; from qeval.storage.llama_libraries import private_cxx_runtime as p; sys.exit(not p())"); then
  export LD_PRELOAD="$(ldconfig -p | grep -m 1 'libstdc++.so.6 ' | sed 's/.*=> //')"
  log "libllama loads no libstdc++.so.6 (linked with its own copy): LD_PRELOAD=$LD_PRELOAD"
fi

# 5. the checks, from outside the checkout (so that the installed qeval is the one imported)
ngl=99; [ "$variant" = cpu ] && ngl=0
(cd / && "$py" "$repo/tools/gpu/checks.py" --kit "$kit" --bin "$bindir" --ngl "$ngl" --out "$out" \
  --build-json "$out/build.json" --started "$t_start" ${mirror:+--mirror "$mirror"} "$@")
