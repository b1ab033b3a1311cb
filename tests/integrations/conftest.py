"""Framework integration tests (Hugging Face, Lightning, torchtitan): run only in the
environment built by ``.ci/integrations_env.sh``::

    make test-integrations

Elsewhere (the main venv, without the frameworks) this folder is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_FILES = {
    "test_hf.py": ("transformers", "accelerate"),
    "test_lightning.py": ("lightning", "transformers"),
    "test_torchtitan.py": ("torchtitan",),
    "test_hf_experts.py": ("transformers",),
    "test_integrations_docs_code.py": ("transformers", "accelerate", "lightning", "torchtitan"),
}
collect_ignore = [
    f for f, mods in _FILES.items() if any(importlib.util.find_spec(m) is None for m in mods)
]
collect_ignore += ["tiny_models.py", "hf_ddp_worker.py", "hf_checkpoint_worker.py"]
collect_ignore += ["hf_fsdp_worker.py", "hf_no_callback_worker.py"]
collect_ignore += ["lightning_ddp_worker.py", "lightning_fsdp_worker.py"]

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
