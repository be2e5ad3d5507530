#!/usr/bin/env bash
# The synthetic-corpus seed table of recipes/large_vocab.py on one GPU, in one call: the recipe's defaults
# (V = 100,000, 10,000 steps) for the default MIDX head, unigram with the same head and M, and the full
# softmax, SEEDS seeds each, all as parallel processes on the one GPU (the model is small: the GPU would
# sit mostly idle with one run), then their table and curves (`recipe_runs.py curves`). On a CPU these runs
# take 40-60 minutes each for the sampled heads and hours for the full softmax.
#
#   bash recipes/benchmarks/gpu_large_vocab.sh                  # RESULTS=gpu-out/large_vocab, SEEDS=3
#   DEVICE=cpu bash recipes/benchmarks/gpu_large_vocab.sh       # a tiny smoke version of the same commands
#
# Extra recipe flags for every run go in ARGS (e.g. ARGS="--vocab_size 262144"); RUN_TIMEOUT (s) stops a run
# that overruns, and the table is written from the runs that finished (a run stopped before a checkpoint leaves
# only its log). The recipe's default length (10,000 steps) is beyond one 10-minute device call for nine runs
# side by side; to fit one, shorten it, e.g. SEEDS=1 ARGS="--max_steps 3000 --train_tokens 4800000"
# RUN_TIMEOUT=480. PACK=<file.tgz> packs $RESULTS without the models; PYTHON picks the interpreter (python3).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-gpu-out/large_vocab}
SEEDS=${SEEDS:-3}
DEVICE=${DEVICE:-cuda}
ARGS=${ARGS:-}
PACK=${PACK:-}
PYTHON=${PYTHON:-python3}
case "$DEVICE" in cuda | cpu) ;; *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
mkdir -p "$RESULTS/runs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cpu ]; then
  # Tiny corpus and model, a few steps: checks the commands and the table, not the figures.
  size=(--use_cpu --vocab_size 3000 --train_tokens 8000 --eval_tokens 500 --test_tokens 500 --max_steps 6
        --eval_steps 3 --logging_steps 2 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --exact_head 64
        --refresh_every_steps 2 --config_overrides n_embd=16,n_inner=32,n_layer=1,n_head=2)
else
  size=()
fi
declare -A configs=([default]="" [unigram]="--sampler unigram" [full]="--sampler full")
pids=()
for seed in $(seq 0 $((SEEDS - 1))); do
  for name in default unigram full; do
    out="$RESULTS/runs/${name}_s$seed"
    # shellcheck disable=SC2086  # the config's and ARGS' flags are words
    timeout "${RUN_TIMEOUT:-540}" "$PYTHON" recipes/large_vocab.py --output_dir "$out" --overwrite_output_dir \
      --seed "$seed" --save_strategy no --report_to none "${size[@]}" ${configs[$name]} $ARGS \
      > "$out.log" 2>&1 &
    pids+=($!)
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
finished=()
for dir in "$RESULTS"/runs/*/; do [ -f "$dir/results.json" ] && finished+=("$dir"); done
echo "runs finished: ${#finished[@]} of ${#pids[@]}"
if [ "${#finished[@]}" -gt 0 ]; then
  MPLBACKEND=Agg "$PYTHON" recipes/benchmarks/recipe_runs.py curves "${finished[@]}" --out "$RESULTS" 2>&1 \
    | tee "$RESULTS/synthetic_curves.log" || status=1
fi
# Without the models (about 50 MB each at V = 100,000): the device tool returns files of at most 16 MiB.
if [ -n "$PACK" ]; then
  tar czf "$PACK.tmp" --exclude='*.safetensors' --exclude='checkpoint-*' "$RESULTS" && mv "$PACK.tmp" "$PACK"
fi
exit $status
