#!/usr/bin/env bash
# Every GPU check of hf-midx in one call (about 5 minutes on one H100 or H200), the most telling
# figures first, so that a call cut short still brings back the head table:
#   1. bench_head at the head shapes of Gemma-3-270M, Qwen2.5-0.5B, Llama-3-8B and Gemma-2-2B (bf16,
#      T = 8192): the HF way, the chunked exact loss, Cut Cross-Entropy, Liger, MIDX's default
#      (per-query and shared pool), and the default head at M = 5 (where the adaptive proposal beats
#      unigram on the synthetic corpus);
#   2. bench_e2e: Gemma-3-270M- and Qwen2.5-0.5B-sized models, sequences of 2,048, bf16: tokens/s and
#      peak memory for the full softmax, CCE, Liger and the default MIDX head (M = 20, and M = 5);
#   3. the hot-path tests (sync count, torch.compile) on CUDA;
#   4. the default head under torch.compile at the Gemma-3-270M shape (its compilation takes ~1 min).
# Results go to $RESULTS (default gpu-out/): JSON, Markdown and logs; with PACK=<file.tgz> they are
# also packed into that archive after each stage (the device tool returns at most 8 files). A GPU
# machine without a package registry needs cut-cross-entropy and liger-kernel as wheels in .whl/
# (see the benchmarks README). DEVICE=cpu runs a tiny smoke version of the same commands.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-gpu-out}
PACK=${PACK:-}
DEVICE=${DEVICE:-cuda}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DEVICE" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
pack() { if [ -n "$PACK" ]; then tar czf "$PACK.tmp" "$RESULTS" && mv "$PACK.tmp" "$PACK"; fi; }
smoke=(); [ "$DEVICE" = cpu ] && smoke=(--smoke)
status=0
timeout "${HEAD_TIMEOUT:-120}" python3 recipes/benchmarks/bench_head.py --device "$DEVICE" "${smoke[@]}" --out "$RESULTS" \
  --no_plots --budget_s 2 --max_mem_gb 60 --models gemma3-270m qwen2.5-0.5b llama3-8b gemma2-2b --samplers midx-rq \
  --default_extra_m 5 --skip_cases midx-rq/per-query midx-rq/shared 2>&1 | tee "$RESULTS/bench_head.log" || status=1
pack
timeout "${E2E_TIMEOUT:-160}" python3 recipes/benchmarks/bench_e2e.py --device "$DEVICE" "${smoke[@]}" --out "$RESULTS" \
  --no_plots --settings gemma3-270m qwen2.5-0.5b --cases hf-full cce liger midx-default --default_extra_m 5 \
  --steps 3 --budget_s 5 \
  2>&1 | tee "$RESULTS/bench_e2e.log" || status=1
pack
HF_MIDX_TEST_DEVICE=$DEVICE timeout "${TESTS_TIMEOUT:-40}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_hot_path.py 2>&1 | tail -15 | tee "$RESULTS/tests.log" || status=1
pack
mkdir -p "$RESULTS/compiled"
timeout "${COMPILE_TIMEOUT:-60}" python3 recipes/benchmarks/bench_head.py --device "$DEVICE" "${smoke[@]}" \
  --out "$RESULTS/compiled" --no_plots --budget_s 2 --compile --models gemma3-270m --samplers midx-rq \
  --skip_cases hf torch-chunked liger cce midx-default/per-query midx-default/shared midx-rq/per-query midx-rq/shared \
  midx-default/shared/compiled 2>&1 | tee "$RESULTS/compiled/bench_head.log" || status=1
pack
exit $status
