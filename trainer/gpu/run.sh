#!/usr/bin/env bash
# Runs the CUDA engine's tests or benchmark on a GPU machine, from binaries built elsewhere
# (`make gpu-bundle` puts them in trainer/gpu/.bundle; the lent GPU machines have no Rust).
#
#   trainer/gpu/run.sh tests [NAME...]
#                              the tests of trainer/tests/gpu.rs (those whose names contain a
#                              NAME, or all), each in its own process under a time limit
#                              (TEST_TIMEOUT seconds, default 300), so a crash or a hang
#                              costs one test, not the run; a summary at the end, exit 1 if
#                              any failed. LOGS=DIR keeps each test's output in DIR; cuDNN
#                              logs the calls it refuses there (CUDNN_LOGLEVEL_DBG=1).
#   trainer/gpu/run.sh bench [ours|torch|loader...]
#                              ResNet-50 bf16 at 224 px, batch 256 and 128 (BATCHES): ours,
#                              with each batch-norm engine (BN_ENGINES), plain and as a CUDA
#                              graph, then fed from host memory every step as `train` is;
#                              next to PyTorch eager and torch.compile; the image-folder
#                              loader alone. All three parts, or those named: each of ours
#                              runs cuDNN's Find again, so a whole bench can outlast one
#                              10-minute device call; split it there.
#
# CUDA's libraries are looked for on LD_LIBRARY_PATH, then in the Python environment's
# nvidia-* wheels (PyTorch's), whose NCCL lacks the unversioned `libnccl.so` cudarc opens:
# a link to it is made in a temporary folder.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${BUNDLE:-$here/.bundle}
# PyTorch's environment on the lent GPU machines, else whatever python3 is on the path.
default_python=python3
[ -x /opt/torch/.venv/bin/python3 ] && default_python=/opt/torch/.venv/bin/python3
python=${PYTHON:-$default_python}
[ -x "$bundle/ringmaster-trainer" ] || { echo "no $bundle/ringmaster-trainer: run 'make gpu-bundle' first" >&2; exit 2; }

libs=$(mktemp -d)
trap 'rm -rf "$libs"' EXIT
site=$("$python" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
extra=""
for dir in "$site"/nvidia/*/lib; do
  [ -d "$dir" ] && extra="$extra:$dir"
done
nccl=$(ls "$site"/nvidia/nccl/lib/libnccl.so.* 2>/dev/null | head -n1 || true)
[ -n "$nccl" ] && ln -sf "$nccl" "$libs/libnccl.so"
export LD_LIBRARY_PATH="$libs$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== libraries from $python's environment: $LD_LIBRARY_PATH"
echo "== $("$bundle/ringmaster-trainer" info | head -c 2000)"
case "${1:-tests}" in
  tests)
    shift $(( $# > 0 ? 1 : 0 ))
    cd "$here/.."   # the tests read fixtures relative to the trainer crate
    logs=${LOGS:-$(mktemp -d)}
    mkdir -p "$logs"
    summary=""
    failed=0
    ran=0
    tests=$("$bundle/gpu-tests" --list --format terse | sed -n 's/: test$//p')
    for test in $tests; do
      if [ $# -gt 0 ]; then
        wanted=no
        for name in "$@"; do case "$test" in *"$name"*) wanted=yes ;; esac; done
        [ "$wanted" = yes ] || continue
      fi
      echo "== $test"
      ran=$((ran + 1))
      started=$(date +%s)
      set +e
      # cuDNN's own account of a call it refuses (which argument, why), errors only.
      CUDNN_LOGLEVEL_DBG=${CUDNN_LOGLEVEL_DBG:-1} CUDNN_LOGDEST_DBG=${CUDNN_LOGDEST_DBG:-stderr} \
        timeout --kill-after=10 "${TEST_TIMEOUT:-300}" "$bundle/gpu-tests" --exact "$test" \
        --test-threads=1 --nocapture >"$logs/$test.log" 2>&1
      status=$?
      set -e
      tail -n 40 "$logs/$test.log"
      case $status in
        0) verdict=ok ;;
        124) verdict="TIMED OUT after ${TEST_TIMEOUT:-300} s" ;;
        137) verdict="KILLED (past the time limit, or out of memory)" ;;
        *) verdict="FAILED (exit $status)" ;;
      esac
      [ $status -eq 0 ] || failed=$((failed + 1))
      summary="$summary$(printf '%-90s %s (%s s)' "$test" "$verdict" $(( $(date +%s) - started )))\n"
    done
    [ "$ran" -gt 0 ] || { echo "no test of $bundle/gpu-tests matches: ${*:-(all)}" >&2; exit 1; }
    printf '\n== summary\n%b' "$summary"
    [ "$failed" -eq 0 ] || { echo "$failed test(s) failed; logs in $logs" >&2; exit 1; }
    ;;
  bench)
    shift
    parts=${*:-ours torch loader}
    wants() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
    # Each batch-norm engine (cuDNN fused where it can, cuDNN plain, ours), as it comes and
    # recorded as a CUDA graph; a run that fails or hangs costs its row only.
    engine() {
      timeout --kill-after=10 "${RUN_TIMEOUT:-240}" \
        "$bundle/ringmaster-trainer" bench-engine --device cuda --precision bf16 \
        --model resnet50 --image-size 224 --steps "${STEPS:-30}" --warmup 5 "$@" \
        || echo "bench-engine $* (batch norm ${RINGMASTER_CUDA_BATCH_NORM:-fused}): exit $?" >&2
    }
    torch_batches=""
    for batch in ${BATCHES:-256 128}; do
      torch_batches="$torch_batches --batch $batch"
      wants ours || continue
      for bn in ${BN_ENGINES:-fused plain own}; do
        for graph in "" --cuda-graph; do
          RINGMASTER_CUDA_BATCH_NORM=$bn engine --batch-size "$batch" $graph
        done
      done
      # The batch uploaded from host memory behind every step, as `train` feeds it: what
      # that costs next to the rows above.
      for graph in "" --cuda-graph; do
        engine --batch-size "$batch" --from-host $graph
      done
    done
    if wants torch; then
      "$python" "$here/bench_torch.py" --steps "${STEPS:-30}" $torch_batches
    fi
    if wants loader; then
      data=$(mktemp -d)
      "$bundle/ringmaster-trainer" make-dataset --out "$data" --classes 8 --per-class 128 --image-size 256 >/dev/null
      "$bundle/ringmaster-trainer" bench-loader --data-dir "$data" --batch-size 256 --batches 8
      rm -rf "$data"
    fi
    ;;
  *) echo "usage: $0 tests|bench" >&2; exit 2 ;;
esac
