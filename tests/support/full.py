"""``PRISM_FULL_TESTS=1``: the variant tests that cover little beyond a sibling.

The full suite must stay well under its 10 minutes on 2 cores, so where several
tests run the same path (one framework at several flags or layouts, one
workload at several sizes) one representative runs always and the others
carry :data:`FULL`: skipped, with a reason that names the switch, unless
``PRISM_FULL_TESTS`` is set. Each gated test names the sibling that covers it.
"""

from __future__ import annotations

import os

import pytest

#: Whether ``PRISM_FULL_TESTS`` is set (to anything non-empty).
ENABLED = bool(os.environ.get("PRISM_FULL_TESTS"))

#: The mark of a variant test: ``@FULL`` or ``pytest.param(..., marks=FULL)``.
FULL = pytest.mark.skipif(not ENABLED, reason="a variant of its sibling test; set PRISM_FULL_TESTS=1 to run it")

__all__ = ["ENABLED", "FULL"]
