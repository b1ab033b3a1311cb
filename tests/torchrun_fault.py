"""``muonscale train`` for torchrun tests, with one rank killed by SIGKILL mid-run.

Run as torchrun's script: ``torchrun ... tests/torchrun_fault.py train --parallel dp ...``.
In torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT=0``), rank
``MUONSCALE_TEST_KILL_RANK`` sends itself SIGKILL right after step
``MUONSCALE_TEST_KILL_AFTER_STEP``: no handler runs and nothing is saved, as when a host dies.
Later attempts (``--max-restarts``) run unchanged.
"""

import os
import signal
import sys

from muonscale.cli import main
from muonscale.train.trainer import TrainingRun


def _install_kill() -> None:
    rank = int(os.environ["MUONSCALE_TEST_KILL_RANK"])
    after = int(os.environ["MUONSCALE_TEST_KILL_AFTER_STEP"])
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or int(os.environ["RANK"]) != rank:
        return
    step = TrainingRun.step

    def step_then_die(self):
        result = step(self)
        if self.step_count == after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    TrainingRun.step = step_then_die


if __name__ == "__main__":
    if "MUONSCALE_TEST_KILL_RANK" in os.environ:
        _install_kill()
    sys.exit(main(sys.argv[1:]))
