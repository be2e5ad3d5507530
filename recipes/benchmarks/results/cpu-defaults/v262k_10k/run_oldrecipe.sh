#!/bin/bash
# V = 262,144, 10,000 steps, seed 0, the old recipe (a rebuild every 100 steps, H = 2,048): two threads on both cores.
cd /work/wt262 && PYTHONPATH=/work/wt262 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 HF_HUB_OFFLINE=1 \
  python recipes/large_vocab.py --output_dir /work/runs/v262k10k/oldrecipe_s0 --vocab_size 262144 --num_samples 20 \
    --codebook_size 32 --seed 0 --max_steps 10000 --train_tokens 16000000 --refresh_every_steps 100 --exact_head 2048 \
    > /work/runs/v262k10k/oldrecipe_s0.log 2>&1
echo done > /work/runs/v262k10k/DONE_oldrecipe
