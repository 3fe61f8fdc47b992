#!/usr/bin/env bash
# The GPU check of issue 61, in one run on a lent GPU machine (docs/gpu.md says what it covers).
#
# Run from the repository root, with $OUT set (a folder whose files come back), after the wheels
# in .whl/ were installed into /tmp/site (the device README's pip line; done here if missing):
#
#   bash scripts/gpu_check.sh
#
# Steps, the most valuable first, each under its own timeout and all under one deadline
# (GPU_CHECK_SECONDS, default 470), none stopping the next:
#   setup    wheels into /tmp/site, the package from this tree, a python3 kernel spec; versions
#   tests    tests/test_gpu.py and tests/test_gpu_*.py, 3 workers, junit XML
#   lessons  lessons 00 03 06 13 14 15 19 executed with CUDA visible (4 at a time), compared
#            with their committed CPU outputs (scripts/gpu_lessons.py)
#   bench    benchmarks/cuda_allreduce.py
# GPU_CHECK_STEPS picks steps for a rerun (default "tests lessons bench"; setup always runs, except
# with GPU_CHECK_SETUP=0: a dry run on a CPU machine, with PY naming a python that has everything).
#
# $OUT gets: log.txt (everything), env.txt (python, torch, GPU, packages), tests.txt (pytest's
# report), junit.xml, lessons.txt (per lesson: ok or where it failed, each differing cell),
# lessons_executed.tar.gz (the executed copies), benchmark.txt. Each step's one-line result goes
# to stdout too.
set -u

OUT=${OUT:?set OUT to the folder for the results}
PY=${PY:-python3}
STEPS=${GPU_CHECK_STEPS-tests lessons bench}
TOTAL=${GPU_CHECK_SECONDS:-470}
LESSONS=${GPU_CHECK_LESSONS:-13_fault_tolerance 19_capstone 14_fsdp 15_tensor_parallel 03_collectives 06_ddp 00_start_here}
RESERVE=15 # seconds kept for packing the results
STARTED=$(date +%s)
LOG=$OUT/log.txt
SITE=/tmp/site
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
mkdir -p "$OUT"
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }
left() { echo $((STARTED + TOTAL - $(date +%s))); }

# run_step NAME LIMIT COMMAND...: COMMAND's output appended to the log, under min(LIMIT, time left).
run_step() {
    local name=$1 limit=$2 rc begun
    shift 2
    local budget=$(($(left) - RESERVE))
    ((budget < limit)) && limit=$budget
    if ((limit < 10)); then
        say "[$name] SKIPPED: the run's ${TOTAL} s are spent"
        return 99
    fi
    echo "===== $name (limit ${limit} s) =====" >>"$LOG"
    begun=$(date +%s)
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    local verdict=ok
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT"
    ((rc != 0 && rc != 124 && rc != 137)) && verdict="exit $rc"
    say "[$name] $verdict after $(($(date +%s) - begun)) s"
    return $rc
}

# Ranks, kernels and controllers a step left (they start sessions of their own, out of timeout's
# reach): named in the log and ended by PID, so that the next step has the machine to itself. Only
# processes of this run are touched: those whose environment holds this run's GPU_CHECK_RUN.
export GPU_CHECK_RUN="$STARTED-$$"
end_leftovers() {
    local pid found=()
    for pid in $(pgrep -f 'ddp_magics|ipykernel|ipyparallel' || true); do
        ((pid == $$)) && continue
        grep -qsz "^GPU_CHECK_RUN=$GPU_CHECK_RUN\$" "/proc/$pid/environ" && found+=("$pid")
    done
    ((${#found[@]})) || return 0
    echo "left running after $1 (ended now):" >>"$LOG"
    ps -o pid,etimes,args -p "$(IFS=,; echo "${found[*]}")" >>"$LOG" 2>&1
    kill -9 "${found[@]}" 2>/dev/null
    return 0
}

# ---------------------------------------------------------------- setup
setup() {
    if [[ ! -d $SITE ]]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
            return 1
    fi
    # The package itself runs from this tree (PYTHONPATH), as an editable install runs it: pip
    # cannot build it here, offline (hatch-jupyter-builder builds the JupyterLab extension with npm
    # from the npm registry), and the GPU run needs no JupyterLab extension.
    local failed=0
    $PY -m ipykernel install --user --name python3 --env PYTHONPATH "$PYTHONPATH" || failed=1
    {
        echo "date: $(date -u)"
        echo "python: $(command -v $PY) $($PY -V 2>&1)"
        $PY - <<'PYTHON'
import torch
import torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "shrink_group", hasattr(dist, "shrink_group"))
import IPython, ipykernel, ipyparallel, ddp_magics
print("ddp_magics from", ddp_magics.__file__)
print("IPython", IPython.__version__, "ipyparallel", ipyparallel.__version__, "ipykernel", ipykernel.__version__)
PYTHON
        echo "cores: $(nproc); memory: $(free -g | awk '/Mem/ {print $2}') GiB"
        nvidia-smi
        $PY -m jupyter kernelspec list
        $PY -m pip list 2>/dev/null | grep -iE '^(torch|numpy|matplotlib|psutil|pytest|pytest-xdist|pytest-timeout|pyzmq|jupyter|nbclient|nbformat|ipy)'
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    return $failed
}

export PYTHONPATH=$SITE:$PWD
export PATH=$SITE/bin:$PATH
export PYTHONUNBUFFERED=1
export OUT PY SITE
export -f setup
say "gpu_check: steps: setup $STEPS; ${TOTAL} s in all; $(date -u)"
if [[ ${GPU_CHECK_SETUP:-1} == 1 ]]; then
    run_step setup 90 bash -c setup
else # a dry run elsewhere: the environment is as it is
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >"$OUT/env.txt" 2>&1
fi
say "$(grep -m1 '^torch' "$OUT/env.txt" 2>/dev/null || echo 'torch: not recorded')"

# ---------------------------------------------------------------- tests
if [[ " $STEPS " == *" tests "* ]]; then
    run_step tests 220 $PY -m pytest -o addopts="" -p no:cacheprovider -p tests.ports -o timeout=150 \
        -n 3 --dist loadfile -rA --junitxml="$OUT/junit.xml" \
        tests/test_gpu.py tests/test_gpu_nccl_one_rank.py tests/test_gpu_gloo_cuda.py \
        tests/test_gpu_nccl_shared_gpu.py
    # pytest's report on its own, from its section of the log
    sed -n '/===== tests (limit/,$p' "$LOG" >"$OUT/tests.txt"
    say "[tests] $(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$OUT/tests.txt" | tail -1 || true)"
    end_leftovers tests
fi

# ---------------------------------------------------------------- lessons
if [[ " $STEPS " == *" lessons "* ]]; then
    mkdir -p "$WORK/lessons"
    for name in $LESSONS; do echo "notebooks/$name.ipynb"; done >"$WORK/lessons.list"
    run_step lessons 160 xargs -a "$WORK/lessons.list" -P 4 -I{} \
        $PY scripts/gpu_lessons.py {} --out "$WORK/lessons" --cell-timeout 180 --budget 130
    : >"$OUT/lessons.txt"
    for name in $LESSONS; do
        if [[ -f $WORK/lessons/$name.txt ]]; then
            cat "$WORK/lessons/$name.txt" >>"$OUT/lessons.txt"
        else
            echo "== $name: no result (the step ended first, or the run broke: see log.txt)" >>"$OUT/lessons.txt"
        fi
    done
    grep '^== ' "$OUT/lessons.txt" | cut -c1-160 | tee -a "$LOG"
    tar -czf "$OUT/lessons_executed.tar.gz" -C "$WORK/lessons" . 2>>"$LOG"
    end_leftovers lessons
fi

# ---------------------------------------------------------------- benchmark
if [[ " $STEPS " == *" bench "* ]]; then
    run_step bench 80 bash -c "set -o pipefail; $PY benchmarks/cuda_allreduce.py | tee '$OUT/benchmark.txt'"
    end_leftovers bench
fi

say "gpu_check: done in $(($(date +%s) - STARTED)) s"
rm -rf "$WORK"
exit 0
