"""Sizes in bytes as people write them ('80GiB', '141e9') and as the plans print them ('1.50 KiB')."""

import re

SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
SIZE_FORMS = (
    "bytes (141e9, 85899345920) or a number with a unit: 80GiB, 80GB, 512MiB (KB MB GB TB = 1000^n bytes, "
    "KiB MiB GiB TiB = 1024^n bytes)"
)


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '141e9', '512 MiB' -> bytes (>= 1); a ValueError names the value and the allowed forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = (match.group(2).upper() or "B") if match else None
    size = int(float(match.group(1)) * SIZE_UNITS[unit]) if unit in SIZE_UNITS else 0
    if size < 1:
        raise ValueError(f"device memory {text!r} is not a size of at least 1 byte; use {SIZE_FORMS}")
    return size


def format_size(size: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 1536 -> '1.50 KiB'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(size) >= SIZE_UNITS[unit.upper()]:
            return f"{size / SIZE_UNITS[unit.upper()]:.2f} {unit}"
    return f"{size} B"
