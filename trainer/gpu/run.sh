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
#   trainer/gpu/run.sh bench [ENGINE...|loader]
#                              ResNet-50 bf16 at 224 px at each of BATCHES (default 256 128):
#                              the ENGINES (default: ours, ours-graph, pytorch-eager,
#                              pytorch-fused, pytorch-graph, pytorch-compile,
#                              pytorch-max-autotune; also ours-from-host,
#                              ours-graph-from-host), each row STEPS (100) timed steps in a
#                              process of its own under nvml_peak.py (the whole process's
#                              device memory by NVML, the same for every engine), REPEATS (3)
#                              times, the engines' order reversed every other repeat; rows
#                              go to $LOGS/bench.jsonl, and summarize.py prints median, min,
#                              max and spread. `loader`: the image-folder loader alone,
#                              on the CPUs and with nvJPEG (its library from the Python
#                              environment's nvidia-nvjpeg wheel, or LD_LIBRARY_PATH).
#   trainer/gpu/run.sh exec COMMAND...
#                              runs COMMAND with CUDA's libraries found as below (a profiler
#                              around the trainer, compare_step.py after a --dump-step).
#   trainer/gpu/run.sh flagship
#                              the flagship sample's trainer arguments (the operator's flags,
#                              tests/fixtures/flagship-train-flags.txt) through the trainer's
#                              own command line, on a learnable folder of 2,560 JPEGs, for
#                              FLAGSHIP_STEPS (default 100) steps.
#
# DEADLINE=EPOCH-SECONDS (exported, for one device call's several run.sh calls) bounds every test and benchmark row: each one's
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

# The tests that run the trainer's command line (under mpirun too) find it here.
export RINGMASTER_TRAINER_BIN="$bundle/ringmaster-trainer"
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
            # Its own limit was cut to the deadline: unfinished, not failed.
            verdict="CUT at the deadline after $seconds s"
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

# One benchmark row, engine $1 at batch $2, repeat $3, under nvml_peak.py; the row with
# its NVML figures goes to $rows. A run that fails or hangs costs its row only.
rows=""
bench_row() {
  local engine=$1 batch=$2 repeat=$3 seconds
  seconds=$(limit "${RUN_TIMEOUT:-420}")
  if [ "$seconds" -eq 0 ]; then skip "$engine at batch $batch (repeat $repeat)"; return; fi
  local command
  case $engine in
    ours|ours-graph|ours-from-host|ours-graph-from-host)
      command=("$bundle/ringmaster-trainer" bench-engine --device cuda --precision bf16
        --model resnet50 --image-size 224 --steps "${STEPS:-100}" --warmup 5 --batch-size "$batch")
      case $engine in *graph*) command+=(--cuda-graph) ;; esac
      case $engine in *from-host) command+=(--from-host) ;; esac ;;
    pytorch-*)
      command=("$python" "$here/bench_torch.py" --mode "${engine#pytorch-}" --batch "$batch"
        --steps "${STEPS:-100}") ;;
    *) echo "unknown engine $engine" >&2; return 1 ;;
  esac
  echo "== $engine, batch $batch, repeat $repeat (at most $seconds s)"
  timeout --kill-after=10 "$seconds" "$python" "$here/nvml_peak.py" --out "$rows" \
    --tag "repeat=$repeat" -- "${command[@]}" || echo "$engine at batch $batch: exit $?" >&2
}

# The engines at each of BATCHES, REPEATS times, alternating their order.
bench_engines() {
  local engines=("$@") repeat batch i order
  for repeat in $(seq 1 "${REPEATS:-3}"); do
    order=("${engines[@]}")
    if [ $((repeat % 2)) -eq 0 ]; then
      order=()
      for ((i = ${#engines[@]} - 1; i >= 0; i--)); do order+=("${engines[i]}"); done
    fi
    for batch in ${BATCHES:-256 128}; do
      for engine in "${order[@]}"; do bench_row "$engine" "$batch" "$repeat"; done
    done
  done
  "$python" "$here/summarize.py" "$rows"
}

# The image-folder loader alone, on ImageNet-sized JPEGs (2,560, `make-dataset
# --imagenet-sizes`): on 4 of this machine's CPUs and on all; then with nvJPEG on the GPU,
# its file reading on 4 threads, its CUDA decoder on 1, 2, 4 and 8 decoding threads
# (LOADER_DECODE_THREADS); each a JSON line with images/s and the CPU cores it kept busy.
bench_loader() {
  local seconds data threads
  seconds=$(limit 240)
  if [ "$seconds" -eq 0 ]; then skip "the loader"; return; fi
  data=$(mktemp -d)
  timeout "$seconds" "$bundle/ringmaster-trainer" make-dataset --out "$data" --classes 10 \
    --per-class 256 --imagenet-sizes || echo "make-dataset: exit $?" >&2
  for threads in 4 "$(nproc)"; do
    seconds=$(limit 60)
    if [ "$seconds" -eq 0 ]; then skip "the loader (cpu, $threads threads)"; continue; fi
    RAYON_NUM_THREADS=$threads timeout "$seconds" "$bundle/ringmaster-trainer" bench-loader \
      --data-dir "$data" --batch-size 256 --batches 9 --decoder cpu \
      || echo "the loader (cpu, $threads threads): exit $?" >&2
  done
  for threads in ${LOADER_DECODE_THREADS:-1 2 4 8}; do
    seconds=$(limit 60)
    if [ "$seconds" -eq 0 ]; then skip "the loader (nvjpeg, $threads decoding threads)"; continue; fi
    RAYON_NUM_THREADS=4 timeout --kill-after=10 "$seconds" "$bundle/ringmaster-trainer" \
      bench-loader --data-dir "$data" --batch-size 256 --batches 9 --decoder nvjpeg \
      --decode-threads "$threads" \
      || echo "the loader (nvjpeg, $threads decoding threads): exit $?" >&2
  done
  # Training from the folder, each decoder feeding ResNet-50 bf16 at batch 256: the last
  # lines (the summary's images/s is the whole run's, warm-up and cuDNN's search included;
  # the step lines' are the recent steps').
  for decoder in cpu nvjpeg; do
    seconds=$(limit 100)
    if [ "$seconds" -eq 0 ]; then skip "training from the folder ($decoder)"; continue; fi
    echo "== train from ImageNet-sized JPEGs, --decoder $decoder"
    timeout --kill-after=10 "$seconds" "$bundle/ringmaster-trainer" train --device cuda \
      --precision bf16 --model resnet50 --batch-size 256 --image-size 224 --data-dir "$data" \
      --steps 50 --log-every 10 --decoder "$decoder" 2>&1 | tail -n 8 \
      || echo "training with --decoder $decoder: exit $?" >&2
  done
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
    logs=${LOGS:-$(mktemp -d)}
    mkdir -p "$logs"
    rows="$logs/bench.jsonl"
    engines=()
    for part in "${@:-ours ours-graph pytorch-eager pytorch-fused pytorch-graph pytorch-compile pytorch-max-autotune}"; do
      for name in $part; do
        case $name in loader) bench_loader ;; *) engines+=("$name") ;; esac
      done
    done
    [ ${#engines[@]} -eq 0 ] || bench_engines "${engines[@]}"
    ;;
  flagship) flagship_cli || status=1 ;;
  exec) shift; "$@" || status=$? ;;
  *) echo "usage: $0 tests|bench|flagship|exec COMMAND..." >&2; exit 2 ;;
esac
[ -z "$skipped" ] || printf '\n== out of time (not started, or cut):\n%b' "$skipped"
exit $status
