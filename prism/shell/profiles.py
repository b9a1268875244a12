"""Cost profiles on disk: the bundled ones and TOML files the user names.

The core parses a profile's text (``prism.core.costmodel.parse_profile``);
this module finds and reads the file.
"""

from __future__ import annotations

import pathlib

from prism.core.costmodel import ZERO, CostModel, ProfileError, parse_profile

__all__ = ["PROFILE_DIR", "load_profile"]

#: The profiles shipped with Prism (``prism/profiles/*.toml``).
PROFILE_DIR = pathlib.Path(__file__).resolve().parent.parent / "profiles"


def load_profile(spec: str | pathlib.Path) -> CostModel:
    """Load a profile: ``"zero"``, a bundled name (``h200_nvlink_ib400``) or a TOML path."""
    if str(spec) == "zero":
        return ZERO
    path = pathlib.Path(spec)
    if not path.suffix and not path.exists():
        path = PROFILE_DIR / f"{spec}.toml"
    if not path.is_file():
        bundled = sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))
        raise ProfileError(f"cost profile {str(spec)!r} not found: give a TOML file path, 'zero', "
                           f"or a bundled profile name ({', '.join(bundled)})")
    return parse_profile(path.read_text(), str(path))
