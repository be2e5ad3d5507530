#!/usr/bin/env bash
# Every GPU check of hf-midx in one call, for a machine with one CUDA GPU (an H100 or H200), most
# telling figures first, so that a call cut short still brings back the head table:
#   1. bench_head at the head shapes of Llama-3-8B, Gemma-2-2B, Qwen2.5-0.5B and Gemma-3-270M (bf16,
#      T = 8192): the HF way, the chunked exact loss, Cut Cross-Entropy, Liger, MIDX's default
#      (per-query and shared pool, eager and compiled);
#   2. bench_e2e: Gemma-3-270M- and Qwen2.5-0.5B-sized models, sequences of 2,048, bf16: tokens/s and
#      peak memory for the full softmax, CCE, Liger and the default MIDX head;
#   3. profile_head: the top ops of one default MIDX step at the Gemma-3-270M shape;
#   4. the CUDA tests (tests/test_cuda.py) and the hot-path tests (sync count, torch.compile) on CUDA.
# Results go to $RESULTS (default gpu-out/): JSON, Markdown and logs; with PACK=<file.tgz> they are
# also packed into that one archive after each stage (the device tool returns at most 8 files).
# A GPU machine without a package registry needs cut-cross-entropy and liger-kernel as wheels in
# .whl/ (see the benchmarks README); they are installed to /tmp/site first. About 7 minutes on an H100.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-gpu-out}
PACK=${PACK:-}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
pack() { if [ -n "$PACK" ]; then tar czf "$PACK.tmp" "$RESULTS" && mv "$PACK.tmp" "$PACK"; fi; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import cut_cross_entropy" 2>/dev/null && echo "cut_cross_entropy: installed" || echo "cut_cross_entropy: missing"
  python3 -c "import liger_kernel" 2>/dev/null && echo "liger_kernel: installed" || echo "liger_kernel: missing"
} 2>&1 | tee "$RESULTS/device.txt"

status=0
timeout "${HEAD_TIMEOUT:-220}" python3 recipes/benchmarks/bench_head.py --device cuda --out "$RESULTS" --no_plots \
  --compile --budget_s 2 --max_mem_gb 60 --models gemma3-270m qwen2.5-0.5b llama3-8b gemma2-2b --samplers midx-rq \
  --skip_cases midx-rq/per-query midx-rq/shared 2>&1 | tee "$RESULTS/bench_head.log" || status=1
pack
timeout "${E2E_TIMEOUT:-180}" python3 recipes/benchmarks/bench_e2e.py --device cuda --out "$RESULTS" --no_plots \
  --settings gemma3-270m qwen2.5-0.5b --cases hf-full cce liger midx-default --steps 3 --budget_s 10 \
  2>&1 | tee "$RESULTS/bench_e2e.log" || status=1
pack
timeout "${PROFILE_TIMEOUT:-45}" python3 recipes/benchmarks/profile_head.py --device cuda --out "$RESULTS" \
  --model gemma3-270m 2>&1 | tee "$RESULTS/profile_head.log" || status=1
pack
HF_MIDX_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-90}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_cuda.py tests/test_hot_path.py tests/test_rng.py 2>&1 | tee "$RESULTS/tests.log" || status=1
pack
exit $status
