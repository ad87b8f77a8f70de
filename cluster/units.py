"""How the cluster's command-line tools write quantities for people: bytes in decimal units.

One home for :func:`bytes_text`, which ``raymoe plan`` (cluster/plan_cli.py) and the memory
check before ``raymoe serve`` (cluster/memory_check.py) both print with.
"""

from __future__ import annotations


def bytes_text(count: float) -> str:
    """Bytes in decimal units (GPU sizes are decimal GB): 93.4 GB, 5.24 MB, 512 B."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}" if count < 100 * scale else f"{count / scale:.0f} {unit}"
    return f"{count:.0f} B"
