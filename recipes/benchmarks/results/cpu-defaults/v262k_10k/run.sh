#!/bin/bash
# V = 262,144, the recipe's whole epoch (16M tokens, 10,000 steps), seed 0: the default against no rebuild, one per core.
run() { core=$1; name=$2; shift 2
  cd /work/wt262 && PYTHONPATH=/work/wt262 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 taskset -c $core \
    python recipes/large_vocab.py --output_dir /work/runs/v262k10k/$name --vocab_size 262144 --num_samples 20 \
      --codebook_size 32 --seed 0 --max_steps 10000 --train_tokens 16000000 "$@" \
      > /work/runs/v262k10k/$name.log 2>&1; }
run 0 auto_s0 & run 1 olddefault_s0 --refresh_every_steps 0 --exact_head 2048 & wait
echo done > /work/runs/v262k10k/DONE
