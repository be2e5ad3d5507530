#!/usr/bin/env bash
# Every GPU check of hf-midx in one call of at most about 9 minutes (the device tool's commands get 10), the
# most telling figures first, so that a call cut short still brings back the head table:
#   0. the device and versions (nvidia-smi, torch, CUDA, transformers, accelerate, triton, CCE, Liger);
#   1. bench_head at the head shapes of Gemma-3-270M, Qwen2.5-0.5B, Llama-3-8B and Gemma-2-2B (bf16,
#      T = 8192): the HF way, the chunked exact loss, Cut Cross-Entropy, Liger, MIDX's default
#      (per-query and shared pool), and the default head at M = 5;
#   2. bench_e2e: Gemma-3-270M- and Qwen2.5-0.5B-sized models, sequences of 2,048, bf16: tokens/s and
#      peak memory for the full softmax, CCE, Liger and the default MIDX head (M = 20, and M = 5);
#   3. the CUDA tests: tests/test_cuda.py (bf16 samplers, losses, head, MidxTrainer) and tests/integration/test_hot_path.py
#      (no host sync in a training step, torch.compile);
#   4. profile_head: the profiler's top ops of the default head's step at the Gemma-3-270M shape;
#   5. the default head under torch.compile at the Gemma-3-270M shape (Inductor; warm-up calls absorb the
#      recompilation that follows the first call);
#   6. gpu_summary: summary.md, the tables of 1 and 2 with the speed-ups against the faster exact loss.
# Stage timeouts (HEAD_TIMEOUT ... COMPILE_TIMEOUT, seconds) add up to about 8.5 minutes. Results go to
# $RESULTS (default gpu-out/): JSON, Markdown and logs; with PACK=<file.tgz> they are also packed into that
# archive after each stage (the device tool returns at most 8 files). A GPU machine without a package registry
# needs cut-cross-entropy and liger-kernel as wheels in .whl/ (see the benchmarks README); only those two are
# installed from there. DEVICE=cpu runs a tiny smoke version of the same commands.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-gpu-out}
PACK=${PACK:-}
DEVICE=${DEVICE:-cuda}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
wheels=(.whl/cut_cross_entropy*.whl .whl/liger_kernel*.whl)
if [ "$DEVICE" = cuda ] && compgen -G ".whl/cut_cross_entropy*.whl" >/dev/null; then
  # Those two alone: datasets or trl without their own dependencies would break `import transformers.Trainer`.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(compgen -G "${wheels[0]}") $(compgen -G "${wheels[1]}") && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
pack() { if [ -n "$PACK" ]; then tar czf "$PACK.tmp" "$RESULTS" && mv "$PACK.tmp" "$PACK"; fi; }
smoke=(); [ "$DEVICE" = cpu ] && smoke=(--smoke)
status=0
{
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  python3 -c "import hf_midx, json; print(json.dumps(hf_midx.versions()))"
  python3 -c "
from importlib.metadata import version
for name in ('triton', 'cut-cross-entropy', 'liger-kernel'):
    try:
        print(name, version(name))
    except Exception as err:
        print(name, 'missing', type(err).__name__)
"
} 2>&1 | tee "$RESULTS/versions.txt"
timeout "${HEAD_TIMEOUT:-110}" python3 recipes/benchmarks/bench_head.py --device "$DEVICE" "${smoke[@]}" --out "$RESULTS" \
  --no_plots --budget_s 2 --max_mem_gb 60 --models gemma3-270m qwen2.5-0.5b llama3-8b gemma2-2b --samplers midx-rq \
  --default_extra_m 5 --skip_cases midx-rq/per-query midx-rq/shared 2>&1 | tee "$RESULTS/bench_head.log" || status=1
pack
timeout "${E2E_TIMEOUT:-150}" python3 recipes/benchmarks/bench_e2e.py --device "$DEVICE" "${smoke[@]}" --out "$RESULTS" \
  --no_plots --settings gemma3-270m qwen2.5-0.5b --cases hf-full cce liger midx-default --default_extra_m 5 \
  --steps 3 --budget_s 5 \
  2>&1 | tee "$RESULTS/bench_e2e.log" || status=1
pack
HF_MIDX_TEST_DEVICE=$DEVICE timeout "${TESTS_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_cuda.py tests/integration/test_hot_path.py 2>&1 | tail -25 | tee "$RESULTS/tests.log" || status=1
pack
timeout "${PROFILE_TIMEOUT:-45}" python3 recipes/benchmarks/profile_head.py --device "$DEVICE" "${smoke[@]}" \
  --out "$RESULTS" --model gemma3-270m 2>&1 | tee "$RESULTS/profile_head.log" || status=1
pack
mkdir -p "$RESULTS/compiled"
timeout "${COMPILE_TIMEOUT:-120}" python3 recipes/benchmarks/bench_head.py --device "$DEVICE" "${smoke[@]}" \
  --out "$RESULTS/compiled" --no_plots --warmup 3 --budget_s 2 --compile --models gemma3-270m --samplers midx-rq \
  --skip_cases hf torch-chunked liger cce midx-default/per-query midx-default/shared midx-rq/per-query midx-rq/shared \
  midx-default/shared/compiled 2>&1 | tee "$RESULTS/compiled/bench_head.log" || status=1
pack
if [ -f "$RESULTS/bench_head.json" ]; then
  python3 recipes/benchmarks/gpu_summary.py "$RESULTS" > "$RESULTS/gpu_summary.log" 2>&1 || status=1
fi
pack
exit $status
