"""Ways to damage a checkpoint on disk, for the tests of what a run does with one it cannot trust."""

import shutil
from pathlib import Path


def largest_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(step_dir: Path) -> None:
    """Cut the model's largest file in half: a write that never finished."""
    f = largest_file(step_dir / "model")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_byte(step_dir: Path) -> None:
    """Flip one bit in the middle of the optimizer state's largest file: silent corruption."""
    f = largest_file(step_dir / "train")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def delete_item(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "train")
