"""File placement shared by the model-repository writers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_or_copy(src: Path, dst: Path, *, link: bool = True) -> None:
    """Hardlink `src` to `dst` (no bytes copied on one filesystem); copy when linking is impossible or unwanted."""
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)
