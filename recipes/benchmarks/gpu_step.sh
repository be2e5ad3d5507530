#!/usr/bin/env bash
# The default head's step on one GPU against Cut Cross-Entropy, Liger, torch's F.linear_cross_entropy and TRL's
# chunked loss, with the cost model's projection beside each hf_midx row (recipes/benchmarks/gpu_step.py), in one
# call that fits a 10-minute window: each section a process of its own under `timeout`, the most telling first:
#   micro (embedding_bag, one bag of V against a GEMV)  MICRO_TIMEOUT   30 s
#   parts (the default step, each launch timed by part)  PARTS_TIMEOUT   50 s
#   head  (4 LLM head shapes + V = 1,048,576, D = 1,024) HEAD_TIMEOUT   220 s  (its cases stop at 180 s)
#   train (a Gemma-3-270M-sized step, body compiled)     TRAIN_TIMEOUT  150 s  (its cases stop at 120 s)
#   merge (gpu_step.json and gpu_step.md)
# 7.5 minutes at most, plus the wheels' install and the merge. Results: $RESULTS (default
# recipes/benchmarks/results/<device>/, e.g. h200), one JSON and log per section, then gpu_step.json / .md.
# Wheels: without a registry the competitors come from .gpu_wheels/ (recipes/benchmarks/gpu_wheels.sh fills it
# where PyPI is reachable; carry it), installed with --no-index into /tmp/gpu_step_site, each only where the
# machine lacks it and it then imports. DEVICE=cpu runs a tiny smoke version
# (seconds; tests/test_gpu_step.py); SECTIONS="micro head" runs only those (then merges).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu_wheels}
case "$DEVICE" in cuda | cpu) ;; *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DEVICE" = cuda ] && [ -d "$WHEELS" ]; then
  site=/tmp/gpu_step_site
  for spec in cut_cross_entropy:cut_cross_entropy liger_kernel:liger_kernel.transformers trl:trl.kernels datasets:datasets; do
    dist=${spec%%:*} module=${spec#*:}
    "$PYTHON" -c "import $module" 2>/dev/null && continue  # the machine has it: keep its own
    for wheel in "$WHEELS"/"$dist"-*.whl; do
      [ -f "$wheel" ] || continue
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" >/dev/null 2>&1 \
        && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c "import $module" 2>/dev/null \
        && echo "installed $(basename "$wheel")" || echo "not usable here: $(basename "$wheel")"
    done
  done
  [ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${RESULTS:-}" ]; then
  if [ "$DEVICE" = cuda ]; then
    name=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())" 2>/dev/null || echo gpu)
  else
    name=cpu-smoke
  fi
  RESULTS=recipes/benchmarks/results/$name
fi
mkdir -p "$RESULTS"
flags=(--device "$DEVICE" --out "$RESULTS")
[ "$DEVICE" = cpu ] && flags+=(--smoke)
status=0
section() {  # name, time limit (s), extra flags
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$PYTHON" recipes/benchmarks/gpu_step.py --section "$name" "${flags[@]}" "$@" 2>&1 \
    | tee "$RESULTS/gpu_step_$name.log" || status=1
}
for name in ${SECTIONS:-micro parts head train}; do
  case "$name" in
    micro) section micro "${MICRO_TIMEOUT:-30}" ;;
    parts) section parts "${PARTS_TIMEOUT:-50}" ;;
    head) section head "${HEAD_TIMEOUT:-220}" --deadline_s "${HEAD_DEADLINE:-180}" ;;
    train) section train "${TRAIN_TIMEOUT:-150}" --deadline_s "${TRAIN_DEADLINE:-120}" ;;
    *) echo "unknown section '$name' (micro parts head train)" >&2; status=1 ;;
  esac
done
"$PYTHON" recipes/benchmarks/gpu_step.py --section merge --out "$RESULTS" > "$RESULTS/gpu_step_merge.log" 2>&1 || status=1
exit $status
