"""How long a checkpoint blocks the train loop, and how long it takes to be written and read back.

    python bench/ckpt_speed.py                    # a 1.0B-parameter model: the 1b preset cut to 9 layers
    python bench/ckpt_speed.py --moments           # ... with its Adam moments too (12 GB of state)
    python bench/ckpt_speed.py --preset tiny --layers 1 --repeats 1 --moments   # smallest: a check
    python bench/ckpt_speed.py --places local,emulator   # a local disk against gs:// on a GCS emulator

`blocked` is the time Checkpoints.save holds the loop: per-array checksums on the device, then Orbax's
copy to host; the write itself goes on in the background until `committed`. `restore` reads the newest
checkpoint back with every checksum verified, as a resume does. `emulator` writes to gs:// on the Cloud
Storage emulator the tests use (tests/servers.py, fake-gcs-server in memory on 127.0.0.1): every object
goes through the GCS JSON API over HTTP (TensorStore for the arrays, gcsfs for Orbax's folders), so it prices
the protocol, not a network or Google's servers.
"""

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # servers.py: the GCS emulator

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
from google.cloud import storage  # noqa: E402
from servers import gcs_emulator  # noqa: E402

import ckpt  # noqa: E402
import data  # noqa: E402
import olmo3  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402


def arguments():
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
    parser.add_argument(
        "--places", default="local", help="local (--dir or a temporary directory), emulator (gs:// on it)"
    )
    return parser.parse_args()


def measure(root: str, model, state, cfg, repeats: int, nbytes: int, say=print) -> None:
    """Save `repeats` checkpoints to run directory `root`, then restore the last, saying the times."""
    say(f"{'save':>5} {'blocked s':>10} {'committed s':>12} {'GiB/s':>7}")
    with ckpt.RunLock(root):
        saver = ckpt.Checkpoints(root, keep_last=2)
        for i in range(1, repeats + 1):
            t0 = time.perf_counter()
            saver.save(i, model, state, {"model": ckpt.config_to_hf(cfg)})
            blocked = time.perf_counter() - t0
            saver.wait()
            total = time.perf_counter() - t0
            say(f"{i:>5} {blocked:>10.2f} {total:>12.2f} {nbytes / 2**30 / total:>7.2f}")
        saver.close()
    like_state = (
        {"opt": ckpt.on_first_device(eqx.filter(state["opt"], eqx.is_array))} if state is not None else None
    )
    t0 = time.perf_counter()
    restored, _, _ = ckpt.Checkpoints(root, read_only=True).read(
        repeats, ckpt.on_first_device(olmo3.abstract(cfg)), like_state
    )
    jax.block_until_ready(restored)
    seconds = time.perf_counter() - t0
    say(f"restore with checksums verified: {seconds:.2f} s ({nbytes / 2**30 / seconds:.2f} GiB/s)")


def main():
    args = arguments()
    cfg = dataclasses.replace(
        olmo3.MODELS[args.preset], n_layers=args.layers, layer_types=(olmo3.FULL,) * args.layers
    )
    model = eqx.filter_jit(olmo3.Olmo3)(cfg, key=jax.random.key(0))
    params = olmo3.count_params(model)
    state = {"opt": train.init_opt(model, train.PRESETS[args.preset])} if args.moments else None
    nbytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter((model, state), eqx.is_array)))
    print(
        f"state: {params / 1e9:.2f}B parameters{' + Adam moments' if args.moments else ''}, "
        f"{nbytes / 2**30:.2f} GiB, on {jax.devices()[0].device_kind}, {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory() as warm:  # compiles the checksums and the restore, timed by neither
        measure(warm, model, state, cfg, 1, nbytes, say=lambda *_: None)
    with contextlib.ExitStack() as stack:
        emulator = None
        for i, place in enumerate(args.places.split(",")):
            if place == "emulator" and emulator is None:  # one for the run: the clients keep its address
                emulator = stack.enter_context(gcs_emulator())
                storage.Client().create_bucket("bench-ckpt")
            if place == "emulator":
                root, said = f"gs://bench-ckpt/run-{i}", " (fake-gcs-server in memory, 127.0.0.1)"
            elif place == "local":
                root, said = args.dir or tempfile.mkdtemp(prefix="ckpt-speed-"), ""
            else:
                raise SystemExit(f"--places {place!r}: expected local or emulator")
            print(f"\n{place}: {root}{said}")
            measure(root, model, state, cfg, args.repeats, nbytes)
            if root != args.dir:  # a temporary directory, or the emulator's memory
                data.remove_tree(root)


if __name__ == "__main__":
    shard.quiet_libtpu()  # before the first device: libtpu without a TPU would fill the log
    main()
