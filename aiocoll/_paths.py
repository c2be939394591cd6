"""Where aiocoll's own code lives: frames and threads started from there are aiocoll's, not a rank's."""

from __future__ import annotations

import os

__all__ = ["PACKAGE_DIR"]

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
"""aiocoll's directory with a trailing separator, so that a ``startswith`` test never
matches a sibling (``site-packages/aiocoll_extra/...``)."""
