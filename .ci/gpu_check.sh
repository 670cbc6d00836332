#!/usr/bin/env bash
# The README's commands, verbatim, on a fresh GPU machine (issue 27), from the repo root, each timed, output tails
# under $OUT. The machine has no package index: the wheels of .ci/gpu_wheels.sh lie in .whl/ and pip finds them
# through the environment (PIP_NO_INDEX, PIP_FIND_LINKS), so the commands themselves stay the README's.
#   .ci/gpu_check.sh tests   install (.[gpu], then the test command: .[test] and the fast suite), and -m gpu
#   .ci/gpu_check.sh demo    install (.[gpu]), and the GPU demo: snakemake --cores 16 --configfile config/gpu.yaml
#   .ci/gpu_check.sh all     both, in that order
#   .ci/gpu_check.sh sampled     the demo's models (timed per rule), then benchmarks/fidelity_sampled.py at T 0.7
#   .ci/gpu_check.sh sampled-mc  the Monte Carlo alone, MC_PROCS processes side by side on the one GPU (disjoint
#                                seeds, MC_RUNS each; the first also makes the served check), combined into one Z;
#                                the demo models carried under resources/demo (built when absent)
#   .ci/gpu_check.sh demo-warm   the demo again on the same machine: results/ made anew, the demo models kept
#   .ci/gpu_check.sh tests-start    the same tests, the fast suite detached (setsid) so that it outlives this
#                                   call (one device call runs at most 600 s; the suite took 888 s on an H200);
#   .ci/gpu_check.sh tests-collect  in the next call (within the machine's idle release): wait for it (at most
#                                   COLLECT_WAIT_S, default 540 s), copy its logs
# On the GPU machine the README's `pip install torch==2.13.0` is replaced by the image's CUDA torch, as the
# README's GPU line says; everything after it is verbatim.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PIP_NO_INDEX=${PIP_NO_INDEX:-1} PIP_FIND_LINKS=${PIP_FIND_LINKS:-$PWD/.whl} PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONUNBUFFERED=1
# The image has python3 (its torch venv) and python3 -m pip; the README says python and pip, and a `pip` or `python`
# on PATH may belong to another interpreter (the system's, without torch: pip then finds no torch to satisfy ours).
py_prefix=$(python3 -c "import sys; print(sys.prefix)")
if [ "$(python -c 'import sys; print(sys.prefix)' 2> /dev/null)" != "$py_prefix" ] \
    || ! pip --version 2> /dev/null | grep -q "from $py_prefix/"; then
    mkdir -p /tmp/gpu_check_bin && export PATH=/tmp/gpu_check_bin:$PATH
    py=$(command -v python3)
    printf '#!/bin/sh\nexec %s "$@"\n' "$py" > /tmp/gpu_check_bin/python
    printf '#!/bin/sh\nexec %s -m pip "$@"\n' "$py" > /tmp/gpu_check_bin/pip
    chmod +x /tmp/gpu_check_bin/python /tmp/gpu_check_bin/pip
fi
summary=$OUT/summary.txt
echo "python: $(command -v python); $(pip --version)" >> "$summary"

# step NAME LIMIT_S COMMAND...: run COMMAND with a wall-clock limit, log to $OUT/NAME.log, one summary line
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc wall $(($(date +%s) - start)) s: $*" | tee -a "$summary"
    tail -n 25 "$OUT/$name.log" > "$OUT/$name.tail"
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1
python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" >> "$summary" 2>&1
step install_gpu 240 'pip install -e ".[gpu]"' || grep -B2 -A12 "conflict is caused\|ResolutionImpossible\|No matching" "$OUT/install_gpu.log" | head -40 >> "$summary"
python -c "import fla, transformers; print('fla', fla.__version__, 'transformers', transformers.__version__)" >> "$summary" 2>&1

if [ "$what" = tests ] || [ "$what" = all ]; then
    # -m gpu beside the fast suite (it uses the GPU, the suite the CPU cores), in a copy of the checkout so that
    # neither sees the other's files
    rm -rf /tmp/gpu_check_copy && cp -r . /tmp/gpu_check_copy && rm -rf /tmp/gpu_check_copy/.whl
    # the README's test command `pip install -e ".[test]" && python -m pytest`, in two steps so that -m gpu starts
    # once pytest is installed
    step install_test 240 'pip install -e ".[test]"'
    (cd /tmp/gpu_check_copy && step gpu_tests 200 'python -m pytest -q -p no:cacheprovider -m gpu') &
    gpu=$!
    step test_command 400 'python -m pytest'
    wait $gpu
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/test_command.log" | tail -15 >> "$summary"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -5 >> "$summary"
fi
# the detached suite keeps its files outside $OUT (a fresh $OUT per call) and outside the checkout (a copy per call)
BG=/tmp/gpu_check_bg
if [ "$what" = tests-start ]; then
    step install_test 240 'pip install -e ".[test]"'
    rm -rf "$BG" && mkdir -p "$BG" && rm -rf /tmp/gpu_check_copy && cp -r . /tmp/gpu_check_copy
    rm -rf /tmp/gpu_check_copy/.whl
    (cd /tmp/gpu_check_copy && setsid -f bash -c "start=\$(date +%s); timeout 1500 python -m pytest > $BG/test_command.log 2>&1; \
        echo \"test_command: rc=\$? wall \$((\$(date +%s) - start)) s: python -m pytest\" > $BG/done")
    step gpu_tests 300 "python -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS_ARGS:-}"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -5 >> "$summary"
fi
if [ "$what" = tests-collect ]; then
    waited=0
    while [ ! -f "$BG/done" ] && [ $waited -lt "${COLLECT_WAIT_S:-540}" ]; do sleep 5; waited=$((waited + 5)); done
    cat "$BG/done" >> "$summary" 2>/dev/null || echo "test_command: still running after ${waited} s more" >> "$summary"
    cp "$BG/test_command.log" "$OUT/" 2>/dev/null
    grep -E "^(FAILED|ERROR)|passed|failed" "$BG/test_command.log" | tail -15 >> "$summary"
fi
if [ "$what" = demo ] || [ "$what" = all ] || [ "$what" = demo-warm ]; then
    # demo-warm: the same machine again (pip's install and Triton's cache warm, the demo models of resources/demo
    # kept), every output under results/ made anew
    # a run killed at its limit leaves Snakemake's lock behind, and the next run would stop at once on it
    [ "$what" = demo-warm ] && rm -rf results && snakemake --unlock --cores 1 --configfile config/gpu.yaml > /dev/null 2>&1
    step gpu_demo "${DEMO_LIMIT_S:-560}" 'snakemake --cores 16 --configfile config/gpu.yaml'
    cp results/summary.md "$OUT/" 2>/dev/null
    # the models a GPU build made must have learned: each dataset's primary tau rises with the training step
    python3 - >> "$summary" 2>&1 << 'PY'
import csv
rows = [r for r in csv.DictReader(open("results/summary.csv")) if r["primary"] == "True"]
for dataset in sorted({r["dataset"] for r in rows}):
    taus = sorted((int(r["training_step"]), float(r["tau_mean_of_samples"]), r["drafter"]) for r in rows if r["dataset"] == dataset)
    rising = all(a[1] < b[1] for a, b in zip(taus, taus[1:]))
    print(f"{dataset}: " + " < ".join(f"{d} {t:.3f}" for _, t, d in taus) + f": rising with step {'yes' if rising else 'NO'}")
PY
    python3 .ci/rule_times.py results/benchmarks > "$OUT/rule_times.md" 2>&1; cat "$OUT/rule_times.md" >> "$summary"
    tar czf "$OUT/demo_logs.tgz" results/logs results/benchmarks results/trust.json results/summary.csv 2>/dev/null
fi
if [ "$what" = sampled ]; then
    # the demo's models through the workflow's own rules (each timed), then the check at T > 0 on them
    snakemake --unlock --cores 1 --configfile config/gpu.yaml > /dev/null 2>&1
    step demo_build 250 'snakemake resources/demo/drafters/step900/config.json --cores 16 --configfile config/gpu.yaml'
    python3 .ci/rule_times.py results/benchmarks > "$OUT/build_times.md" 2>&1; cat "$OUT/build_times.md" >> "$summary"
    step fidelity_sampled 330 "python benchmarks/fidelity_sampled.py --target resources/demo/target \
        --drafter resources/demo/drafters/step900 --prompts resources/prompts/demo_code.jsonl --device cuda:0 \
        --backend fla --dtypes bfloat16 float32 --samples 16 --n 2 --runs 120 --mc-dtypes bfloat16 \
        --server-threads 8 --record $OUT/fidelity_sampled.md --json $OUT/fidelity_sampled.json"
    tail -n 40 "$OUT/fidelity_sampled.log" >> "$summary"
fi
if [ "$what" = sampled-mc ]; then
    snakemake --unlock --cores 1 --configfile config/gpu.yaml > /dev/null 2>&1
    [ -f resources/demo/drafters/step900/config.json ] \
        || step demo_build 250 'snakemake resources/demo/drafters/step900/config.json --cores 16 --configfile config/gpu.yaml'
    # the first process makes the served check too, so it runs fewer of the seeds
    procs=${MC_PROCS:-4} runs=${MC_RUNS:-50} first_runs=${MC_RUNS_FIRST:-${MC_RUNS:-50}} seed=0
    mkdir -p "$OUT/mc"
    for i in $(seq 0 $((procs - 1))); do
        served="" n=$runs
        [ "$i" = 0 ] && served=bfloat16 n=$first_runs
        (OUT=$OUT/mc step mc_$i 450 "python benchmarks/fidelity_sampled.py --target resources/demo/target \
            --drafter resources/demo/drafters/step900 --prompts resources/prompts/demo_code.jsonl --device cuda:0 \
            --backend fla --dtypes $served --samples 16 --n 2 --runs $n --first-seed $seed \
            --mc-dtypes bfloat16 --server-threads 3 --record $OUT/mc/mc_$i.md --json $OUT/mc/mc_$i.json") &
        seed=$((seed + n))
    done
    if [ -n "${MC_DEBUG:-}" ]; then
        # two extract + evaluate in one CUDA process (--in-process), killed with a traceback if it stalls
        (OUT=$OUT/mc step stall 300 "timeout -s ABRT 240 python -X faulthandler benchmarks/fidelity_sampled.py \
            --target resources/demo/target --drafter resources/demo/drafters/step900 \
            --prompts resources/prompts/demo_code.jsonl --device cuda:0 --backend fla --dtypes bfloat16 float32 \
            --samples 4 --n 2 --runs 0 --in-process --server-threads 2 --record $OUT/mc/stall.md") &
    fi
    wait
    python benchmarks/fidelity_sampled.py --combine "$OUT"/mc/mc_*.json --record "$OUT/mc_combined.md" >> "$summary" 2>&1
    tar czf "$OUT/mc.tgz" -C "$OUT" mc && rm -rf "$OUT/mc"
fi
cat "$summary"
