#!/bin/bash
# The same short V = 262,144 run (auto defaults, seed 1, 400 steps) from the old (866d56e) and the new (df60758) tree, one per core.
run() { tree=$1; core=$2; name=$3
  cd $tree && PYTHONPATH=$tree OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 taskset -c $core \
    python recipes/large_vocab.py --output_dir /work/runs/timecheck/$name --vocab_size 262144 --num_samples 20 \
      --codebook_size 32 --seed 1 --max_steps 400 --train_tokens 8000000 --eval_tokens 5000 --test_tokens 5000 \
      > /work/runs/timecheck/$name.log 2>&1; }
mkdir -p /work/runs/timecheck
run /work/wt866 0 old866 & run /work/wtnew 1 newdf60 & wait
echo done > /work/runs/timecheck/DONE
