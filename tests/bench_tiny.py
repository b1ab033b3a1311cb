"""What the bench tests share: the smallest `muonscale bench` command line (one layer, d 32, two
steps of 256 tokens, no probes, plots or progress bars, contenders interleaved in one process;
tests/test_bench_lockstep.py checks the worker processes against that) and a fake training run
whose loss falls linearly, for tests of the bench's bookkeeping without training."""

BENCH_TINY = (
    "--n-layer 1 --d-model 32 --n-head 2 --steps 2 --tokens-per-step 256 --eval-batches 1 "
    "--lr-warmup-steps 1 --memory-probe-steps 0 --timing-warmup-steps 0 --no-progress --no-plots "
    "--workers 1"
).split()


class FakeStep:
    """One step's record as the bench reads it."""

    def __init__(self, loss):
        self.loss, self.tokens, self.step_seconds, self.optimizer_seconds = loss, 256, 0.01, 0.001


class LinearRun:
    """A run whose training and validation loss is 5 − rate · steps."""

    def __init__(self, rate):
        self.rate, self.steps = rate, 0

    def step(self):
        self.steps += 1
        return FakeStep(5.0 - self.rate * self.steps)

    def evaluate(self):
        return 5.0 - self.rate * self.steps

    def optimizer_state_bytes(self):
        return 100


TINY_CONFIG = dict(
    n_layer=1,
    d_model=32,
    n_head=2,
    tokens_per_step=256,
    eval_batches=1,
    lr_warmup_steps=1,
    memory_probe_steps=0,
    timing_warmup_steps=0,
    progress=False,
    plots=False,
)
"""``BenchConfig`` keyword arguments of the same tiny bench as :data:`BENCH_TINY` (no steps)."""
