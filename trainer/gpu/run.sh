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
#   trainer/gpu/run.sh flagship
#                              the flagship sample's trainer arguments (the operator's flags,
#                              tests/fixtures/flagship-train-flags.txt) through the trainer's
#                              own command line, on a learnable folder of 2,560 JPEGs, for
#                              FLAGSHIP_STEPS (default 100) steps.
#   trainer/gpu/run.sh session everything issue 13 asks for, most telling first, within one
#                              device call: the tests but the flagship (TEST_TIMEOUT default 90
#                              here); ResNet-50 at batch 256, ours with cuDNN's fused batch
#                              norm (plain and as a CUDA graph) and PyTorch eager; the
#                              flagship's 300 steps (test, then command line);
#                              torch.compile at 256; the loader; then batch 128 and the
#                              other batch-norm engines. It
#                              stops starting work SESSION_SECONDS (default 500) after it
#                              began, and ends each part at that point, so what ran comes back
#                              within the call's limit; what had no time left is listed.
#
# DEADLINE=EPOCH-SECONDS (set by `session`, or exported for several calls) bounds every test and benchmark row: each one's
# time limit is cut to what is left, one with under 20 s left is not started, and a test
# stopped by a limit so cut is listed as cut, not failed. Time limits are whole seconds.
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
# The time limits are whole seconds (`timeout`'s 5m and 0 for "none" would not mix with the
# deadline's arithmetic).
for limit_name in TEST_TIMEOUT RUN_TIMEOUT TORCH_TIMEOUT SESSION_SECONDS; do
  case ${!limit_name:-1} in
    ''|0|*[!0-9]*) echo "$limit_name=${!limit_name}: a whole number of seconds, at least 1" >&2; exit 2 ;;
  esac
done
# Seconds left before DEADLINE, at most $1 (the part's own limit); 0 once under 20 s are left.
limit() {
  local own=$1
  [ -n "${DEADLINE:-}" ] || { echo "$own"; return; }
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$left" -lt "$own" ]; then echo "$left"; else echo "$own"; fi
}
skipped=""
skip() { skipped="$skipped  $*\n"; echo "== out of time: $*" >&2; }

# The tests of gpu-tests whose names contain one of the arguments, in the arguments' order
# (all, in the binary's order, without arguments), EXCEPT=NAME… left out; each in its own
# process under its own time limit.
run_tests() {
  # Called under `||`, where bash ignores `set -e`: each step that can fail says so itself.
  local logs=${LOGS:-$(mktemp -d)} summary="" failed=0 ran=0 cut=0 test name unwanted status verdict started seconds
  local own=${TEST_TIMEOUT:-300}
  mkdir -p "$logs" && logs=$(cd "$logs" && pwd) || { echo "LOGS=$logs: not a folder I can write" >&2; return 1; }
  local all ordered=""
  all=$("$bundle/gpu-tests" --list --format terse) || { echo "$bundle/gpu-tests --list failed" >&2; return 1; }
  all=$(printf '%s\n' "$all" | sed -n 's/: test$//p')
  for name in "${@:-}"; do
    for test in $all; do
      case "$test" in *"$name"*) ;; *) continue ;; esac
      case " $ordered " in *" $test "*) continue ;; esac
      for unwanted in ${EXCEPT:-}; do case "$test" in *"$unwanted"*) continue 2 ;; esac; done
      ordered="$ordered $test"
    done
  done
  for test in $ordered; do
    seconds=$(limit "$own")
    if [ "$seconds" -eq 0 ]; then skip "test $test"; cut=$((cut + 1)); continue; fi
    echo "== $test (at most $seconds s)"
    ran=$((ran + 1))
    started=$(date +%s)
    set +e
    # cuDNN's own account of a call it refuses (which argument, why), errors only.
    ( cd "$here/.." &&   # the tests read fixtures relative to the trainer crate
      CUDNN_LOGLEVEL_DBG=${CUDNN_LOGLEVEL_DBG:-1} CUDNN_LOGDEST_DBG=${CUDNN_LOGDEST_DBG:-stderr} \
        timeout --kill-after=10 "$seconds" "$bundle/gpu-tests" --exact "$test" \
        --test-threads=1 --nocapture >"$logs/$test.log" 2>&1 )
    status=$?
    set -e
    tail -n 40 "$logs/$test.log"
    case $status in
      0) verdict=ok ;;
      124|137) if [ "$seconds" -lt "$own" ]; then
            # Its own limit was cut to the session's end: unfinished, not failed.
            verdict="CUT at the session's end after $seconds s"
            skip "test $test (cut after $seconds s)"
            cut=$((cut + 1))
          elif [ $status -eq 124 ]; then verdict="TIMED OUT after $seconds s"
          else verdict="KILLED (past the time limit, or out of memory)"; fi ;;
      *) verdict="FAILED (exit $status)" ;;
    esac
    case $verdict in ok|CUT*) ;; *) failed=$((failed + 1)) ;; esac
    summary="$summary$(printf '%-90s %s (%s s)' "$test" "$verdict" $(( $(date +%s) - started )))\n"
  done
  [ "$ran" -gt 0 ] || [ "$cut" -gt 0 ] || { echo "no test of $bundle/gpu-tests matches: ${*:-(all)}" >&2; return 1; }
  printf '\n== tests\n%b' "$summary"
  [ "$failed" -eq 0 ] || { echo "$failed test(s) failed; logs in $logs" >&2; return 1; }
}

# One row of ours: ResNet-50 bf16 224 px, with the batch-norm engine $RINGMASTER_CUDA_BATCH_NORM
# (fused by default); a run that fails or hangs costs its row only.
engine() {
  local seconds
  seconds=$(limit "${RUN_TIMEOUT:-240}")
  if [ "$seconds" -eq 0 ]; then skip "bench-engine $* (batch norm ${RINGMASTER_CUDA_BATCH_NORM:-fused})"; return; fi
  timeout --kill-after=10 "$seconds" \
    "$bundle/ringmaster-trainer" bench-engine --device cuda --precision bf16 \
    --model resnet50 --image-size 224 --steps "${STEPS:-30}" --warmup 5 "$@" \
    || echo "bench-engine $* (batch norm ${RINGMASTER_CUDA_BATCH_NORM:-fused}): exit $?" >&2
}

# Ours at each of BATCHES with each of BN_ENGINES, as it comes and as a CUDA graph, then fed
# from host memory every step as `train` is (what that costs next to the rows before it).
bench_ours() {
  local batch bn graph
  for batch in ${BATCHES:-256 128}; do
    for bn in ${BN_ENGINES:-fused plain own}; do
      for graph in "" --cuda-graph; do
        RINGMASTER_CUDA_BATCH_NORM=$bn engine --batch-size "$batch" $graph
      done
    done
    for graph in "" --cuda-graph; do
      engine --batch-size "$batch" --from-host $graph
    done
  done
}

# PyTorch in each of TORCH_MODES (eager, compiled: torch.compile takes minutes) at each of
# BATCHES, in one process.
bench_torch() {
  local seconds args="" batch mode
  for mode in ${TORCH_MODES:-eager compiled}; do args="$args --mode $mode"; done
  for batch in ${BATCHES:-256 128}; do args="$args --batch $batch"; done
  seconds=$(limit "${TORCH_TIMEOUT:-420}")
  if [ "$seconds" -eq 0 ]; then skip "PyTorch$args"; return; fi
  timeout --kill-after=10 "$seconds" "$python" "$here/bench_torch.py" --steps "${STEPS:-30}" $args \
    || echo "bench_torch.py$args: exit $?" >&2
}

# The image-folder loader alone, on this machine's CPUs.
bench_loader() {
  local seconds data
  seconds=$(limit 120)
  if [ "$seconds" -eq 0 ]; then skip "the loader"; return; fi
  data=$(mktemp -d)
  timeout "$seconds" sh -c '"$1" make-dataset --out "$2" --classes 8 --per-class 128 --image-size 256 >/dev/null &&
    "$1" bench-loader --data-dir "$2" --batch-size 256 --batches 8' _ "$bundle/ringmaster-trainer" "$data" \
    || echo "the loader: exit $?" >&2
  rm -rf "$data"
}

# The flagship sample's trainer arguments through `ringmaster-trainer train`, as a rank runs
# them (the epochs, folders replaced; the warm-up of its 16 ranks' global batch, as the
# flagship test asks).
flagship_cli() {
  local seconds data flags
  seconds=$(limit "${RUN_TIMEOUT:-240}")
  if [ "$seconds" -eq 0 ]; then skip "the flagship's command line"; return 0; fi
  flags=$(grep -v -e '^--epochs' -e '^--data-dir' -e '^--output-dir' \
    "$here/../tests/fixtures/flagship-train-flags.txt") || { echo "no flagship flags" >&2; return 1; }
  data=$(mktemp -d)
  local failed=0
  # shellcheck disable=SC2086 # one flag a line, none with spaces
  { "$bundle/ringmaster-trainer" make-dataset --out "$data/images" --classes 10 --per-class 256 \
      --image-size 224 >/dev/null &&
    timeout --kill-after=10 "$seconds" "$bundle/ringmaster-trainer" train $flags --warmup-epochs=5 \
      --data-dir "$data/images" --output-dir "$data/out" --steps "${FLAGSHIP_STEPS:-100}" \
      --log-every 20; } || { echo "the flagship's command line: exit $?" >&2; failed=1; }
  rm -rf "$data"
  return $failed
}

status=0
case "${1:-tests}" in
  tests)
    shift $(( $# > 0 ? 1 : 0 ))
    run_tests "$@" || status=1
    ;;
  bench)
    shift
    parts=${*:-ours torch loader}
    case " $parts " in *" ours "*) bench_ours ;; esac
    case " $parts " in *" torch "*) bench_torch ;; esac
    case " $parts " in *" loader "*) bench_loader ;; esac
    ;;
  session)
    DEADLINE=$(( $(date +%s) + ${SESSION_SECONDS:-500} ))
    flagship=the_flagship_samples_arguments
    echo "== session: until $(date -d "@$DEADLINE" +%T)"
    # The backend's operations first, then whole steps and models: an early failure says
    # most about what the later ones will do.
    EXCEPT=$flagship TEST_TIMEOUT=${TEST_TIMEOUT:-90} run_tests uploads_and_downloads \
      activation_pooling gemm_bias convolutions batch_norm a_cifar_step gradients_on_the_gpu \
      batches_uploaded cuda_graph nccl resnet18 resnet50 "" || status=1
    for graph in "" --cuda-graph; do
      RINGMASTER_CUDA_BATCH_NORM=fused engine --batch-size 256 $graph
    done
    BATCHES=256 TORCH_MODES=eager bench_torch
    TEST_TIMEOUT=300 run_tests "$flagship" || status=1
    flagship_cli || status=1
    BATCHES=256 TORCH_MODES=compiled bench_torch
    bench_loader
    BATCHES=128 BN_ENGINES=fused bench_ours
    BATCHES=128 bench_torch
    for bn in plain own; do
      for graph in "" --cuda-graph; do
        RINGMASTER_CUDA_BATCH_NORM=$bn engine --batch-size 256 $graph
      done
    done
    for graph in "" --cuda-graph; do
      engine --batch-size 256 --from-host $graph
    done
    ;;
  flagship) flagship_cli || status=1 ;;
  *) echo "usage: $0 tests|bench|flagship|session" >&2; exit 2 ;;
esac
[ -z "$skipped" ] || printf '\n== out of time (not started, or cut):\n%b' "$skipped"
exit $status
