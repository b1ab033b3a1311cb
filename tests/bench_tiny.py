"""The smallest `muonscale bench` command line the bench tests share: one layer, d 32, two steps
of 256 tokens, no probes, plots or progress bars (a few seconds on 2 cores)."""

BENCH_TINY = (
    "--n-layer 1 --d-model 32 --n-head 2 --steps 2 --tokens-per-step 256 --eval-batches 1 "
    "--lr-warmup-steps 1 --memory-probe-steps 0 --timing-warmup-steps 0 --no-progress --no-plots"
).split()
