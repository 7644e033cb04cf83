"""What `train.py --preset 7b --dry_run` reports for a 256-chip slice (a TPU v5p-512, say), compiled on this
machine's CPU with 256 fake devices: memory per device and FLOPs per step, before renting the slice.

    python bench/dry_run_7b.py                          # pure FSDP, and FSDP x 8-way tensor parallelism
    python bench/dry_run_7b.py fsdp=64,tensor=4 -- --microbatch 1

Each mesh compiles in its own process (the fake device count is fixed when JAX starts). The CPU compiles
the reference attention, which materialises seq x seq scores, so its "activations + temporaries" overstate
what a TPU's splash kernel needs; parameters, optimizer state and FLOPs are those of the real run.
"""

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MESHES = ["fsdp=-1", "fsdp=32,tensor=8"]


def main(argv: list[str]) -> int:
    meshes, _, extra = " ".join(argv).partition("--")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=256", JAX_PLATFORMS="cpu")
    for mesh in meshes.split() or MESHES:
        args = ["--preset", "7b", "--dry_run", "--mesh", mesh, *extra.split()]
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as run_dir:  # the dry run writes only config.json there
            out = subprocess.run([sys.executable, "train.py", *args, "--run_dir", run_dir], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
        wall = time.perf_counter() - t0
        report = out.stdout[out.stdout.find("dry run:"):] if "dry run:" in out.stdout else out.stderr[-3000:]
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB, largest so far
        print(f"$ python train.py {' '.join(args)}   (256 fake CPU devices)\n{report.rstrip()}\n"
              f"[{wall:.0f} s in all, at most {rss:.1f} GiB of host memory, exit code {out.returncode}]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
