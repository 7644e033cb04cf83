"""How long a checkpoint blocks the train loop, and how long it takes to be written and read back.

    python bench/ckpt_speed.py                    # a 1.0B-parameter model: the 1b preset cut to 9 layers
    python bench/ckpt_speed.py --moments           # ... with its Adam moments too (12 GB of state)
    python bench/ckpt_speed.py --preset tiny --layers 1 --repeats 1 --moments   # smallest: a check

`blocked` is the time Checkpoints.save holds the loop: per-array checksums on the device, then Orbax's
copy to host; the write itself goes on in the background until `committed`. `restore` reads the newest
checkpoint back with every checksum verified, as a resume does.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import ckpt  # noqa: E402
import olmo3  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", default="1b", choices=list(olmo3.MODELS), help="the model cut to --layers"
    )
    parser.add_argument(
        "--layers", type=int, default=9, help="layers of the preset (1b, 9: 1.01B parameters)"
    )
    parser.add_argument("--moments", action="store_true", help="save the Adam moments too (3x the bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    cfg = dataclasses.replace(
        olmo3.MODELS[args.preset], n_layers=args.layers, layer_types=(olmo3.FULL,) * args.layers
    )
    model = eqx.filter_jit(olmo3.Olmo3)(cfg, key=jax.random.key(0))
    params = olmo3.count_params(model)
    state = {"opt": train.init_opt(model, train.PRESETS[args.preset])} if args.moments else None
    nbytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter((model, state), eqx.is_array)))
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-speed-"))
    print(
        f"state: {params / 1e9:.2f}B parameters{' + Adam moments' if args.moments else ''}, "
        f"{nbytes / 2**30:.1f} GiB, written to {root} on {jax.devices()[0].device_kind}, {os.cpu_count()} cores"
    )
    print(f"{'save':>5} {'blocked s':>10} {'committed s':>12} {'GiB/s':>7}")
    saver = ckpt.Checkpoints(root, keep_last=2)
    for i in range(1, args.repeats + 1):
        t0 = time.perf_counter()
        saver.save(i, model, state, {"model": ckpt.config_to_hf(cfg)})
        blocked = time.perf_counter() - t0
        saver.wait()
        total = time.perf_counter() - t0
        print(f"{i:>5} {blocked:>10.2f} {total:>12.2f} {nbytes / 2**30 / total:>7.2f}")
    saver.close()
    like_state = (
        {"opt": ckpt.on_first_device(eqx.filter(state["opt"], eqx.is_array))} if args.moments else None
    )
    t0 = time.perf_counter()
    restored, _, _ = ckpt.Checkpoints(root).read(
        args.repeats, ckpt.on_first_device(olmo3.abstract(cfg)), like_state
    )
    jax.block_until_ready(restored)
    print(f"restore with checksums verified: {time.perf_counter() - t0:.2f} s")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    shard.quiet_libtpu()  # before the first device: libtpu without a TPU would fill the log
    main()
