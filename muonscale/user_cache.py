"""The user cache folder: ``$MUONSCALE_CACHE_DIR``, else ``$XDG_CACHE_HOME/muonscale``, else
``~/.cache/muonscale``. Only derived files live there (a trained tokenizer, a compiled CPU
kernel), each keyed by what it was made from, so deleting the folder loses nothing."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder (not created here)."""
    if os.environ.get("MUONSCALE_CACHE_DIR"):
        return Path(os.environ["MUONSCALE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "muonscale"
