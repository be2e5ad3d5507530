#!/usr/bin/env bash
# Every GPU check of hf-midx in one call, for a machine with one CUDA GPU (an H100 or H200):
#   1. the CUDA tests (tests/test_cuda.py) and the hot-path tests (sync count, torch.compile) on CUDA;
#   2. bench_head at the head shapes of Llama-3-8B, Gemma-2-2B, Qwen2.5-0.5B and Gemma-3-270M (bf16,
#      T = 8192): the HF way, the chunked exact loss, Cut Cross-Entropy, Liger, MIDX (eager and compiled);
#   3. profile_head: the top ops of one default MIDX step at the Gemma-3-270M shape;
#   4. bench_e2e: a Gemma-3-270M-sized model (18 layers, V = 262,144), sequences of 2,048, bf16:
#      tokens/s and peak memory for the full softmax, CCE, Liger and the default MIDX head.
# Results go to $OUT (default gpu-out/): JSON, Markdown and logs. A GPU machine without a package
# registry needs cut-cross-entropy, liger-kernel (and triton if missing) as wheels in .whl/ (see the
# device README); they are installed to /tmp/site first. About 8 minutes on one H100.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import cut_cross_entropy" 2>/dev/null && echo "cut_cross_entropy: installed" || echo "cut_cross_entropy: missing"
  python3 -c "import liger_kernel" 2>/dev/null && echo "liger_kernel: installed" || echo "liger_kernel: missing"
} 2>&1 | tee "$OUT/device.txt"

status=0
HF_MIDX_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -x tests/test_cuda.py tests/test_hot_path.py tests/test_rng.py \
  2>&1 | tee "$OUT/tests.log" || status=1
timeout 240 python3 recipes/benchmarks/bench_head.py --device cuda --out "$OUT" --no_plots --compile --budget_s 3 \
  --models llama3-8b gemma2-2b qwen2.5-0.5b gemma3-270m --samplers midx-rq \
  --skip_cases midx-rq/per-query midx-rq/shared 2>&1 | tee "$OUT/bench_head.log" || status=1
timeout 60 python3 recipes/benchmarks/profile_head.py --device cuda --out "$OUT" --model gemma3-270m \
  2>&1 | tee "$OUT/profile_head.log" || status=1
timeout 180 python3 recipes/benchmarks/bench_e2e.py --device cuda --out "$OUT" --no_plots --settings gemma3-270m \
  --cases hf-full cce liger midx-default --steps 3 2>&1 | tee "$OUT/bench_e2e.log" || status=1
exit $status
