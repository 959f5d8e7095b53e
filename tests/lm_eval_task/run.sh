#!/usr/bin/env bash
# lm-evaluation-harness's `local-completions` model on the tiny multiple-choice task in this
# folder, end to end against a Folio server: every answer choice is a loglikelihood request
# (/v1/completions with echo=true, logprobs=1, max_tokens=1, prompts as token ids).
#
#   tests/lm_eval_task/run.sh              starts `folio serve` (default model, float32) on a
#                                          free port and stops it afterwards
#   tests/lm_eval_task/run.sh http://HOST:PORT   uses a running server
#   COMPARE_HF=1 tests/lm_eval_task/run.sh       also runs lm-eval's own transformers model
#                                          (`hf`) on the task and checks both agree
#   QUANTIZATIONS="int8 int4" tests/lm_eval_task/run.sh   also serves the model quantized and
#                                          prints each choice's loglikelihood next to the
#                                          unquantized one's (compare.py --report)
#
# Needs lm_eval: `pip install -e '.[eval]'`, or LM_EVAL=/path/to/bin/lm_eval. No network: the
# data set is the local JSONL and the tokenizer the served model's local directory.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
FOLIO=${FOLIO:-.venv/bin/folio}
LM_EVAL=${LM_EVAL:-lm_eval}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

server_pid=""
stop_server() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; server_pid=""; }
trap stop_server EXIT

# start_server NAME [FLAGS...]: `folio serve` (default model, float32) on a free port -> base_url
start_server() {
  local name=$1
  shift
  local port
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  base_url=http://127.0.0.1:$port
  "$FOLIO" serve --port "$port" --grpc-port 0 --engine-port 0 --tokenizer-port 0 \
    --dtype float32 --max-model-len 2048 "$@" >"$OUT/serve-$name.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1200); do
    if curl -sf "$base_url/health" >/dev/null; then return; fi
    kill -0 "$server_pid" 2>/dev/null || { cat "$OUT/serve-$name.log"; exit 1; }
    sleep 0.5
  done
  echo "folio serve ($name) did not start" >&2
  exit 1
}

# evaluate NAME: the task through lm-eval's local-completions model against base_url -> OUT/NAME
evaluate() {
  local model model_dir
  # The served model's name and its local directory (for the tokenizer) from /v1/models.
  read -r model model_dir < <(curl -sf "$base_url/v1/models" | "$PYTHON" -c \
    'import json, sys; card = json.load(sys.stdin)["data"][0]; print(card["id"], card["root"])')
  served_model_dir=${TOKENIZER:-$model_dir}
  "$LM_EVAL" --model local-completions \
    --model_args "model=$model,base_url=$base_url/v1/completions,tokenizer_backend=huggingface,tokenizer=$served_model_dir,num_concurrent=1,max_retries=1" \
    --tasks folio_tiny_mc --include_path tests/lm_eval_task \
    --output_path "$OUT/$1" --log_samples --seed 1234 --batch_size 8 | tee "$OUT/$1.txt"
}

if [ $# -ge 1 ]; then
  base_url=$1
else
  start_server folio
fi
evaluate folio
stop_server

if [ "${COMPARE_HF:-0}" = 1 ]; then
  "$LM_EVAL" --model hf --model_args "pretrained=$served_model_dir,dtype=float32" --device cpu \
    --tasks folio_tiny_mc --include_path tests/lm_eval_task \
    --output_path "$OUT/hf" --log_samples --seed 1234 --batch_size 8 | tee "$OUT/hf.txt"
  "$PYTHON" tests/lm_eval_task/compare.py "$OUT/folio" "$OUT/hf"
fi

# Each quantization against the unquantized run, item by item (a report, not a check).
for quantization in ${QUANTIZATIONS:-}; do
  start_server "$quantization" --quantization "$quantization"
  evaluate "folio-$quantization"
  stop_server
  echo "== $quantization against unquantized, per choice"
  "$PYTHON" tests/lm_eval_task/compare.py --report "$OUT/folio" "$OUT/folio-$quantization"
done
