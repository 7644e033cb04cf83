"""Run tests/faults.py (so train.py) over a folder that renames no directory, as a gcsfuse mount of a flat
bucket: a directory rename under $NO_DIR_RENAMES fails with EXDEV, as gcsfuse's does without
--rename-dir-limit; files rename as before.

    NO_DIR_RENAMES=RUN_DIR python tests/gcsfuse.py MOMENT:STEP [train.py flags...]
"""

import errno
import os
import runpy
import sys

ROOT = os.path.realpath(os.environ["NO_DIR_RENAMES"])


def refusing(rename):
    def rename_no_dir(src, dst, *args, **kwargs):
        if os.path.isdir(src) and os.path.realpath(src).startswith(ROOT + os.sep):
            raise OSError(errno.EXDEV, f"{os.strerror(errno.EXDEV)} (a directory, on gcsfuse)", str(src))
        return rename(src, dst, *args, **kwargs)

    return rename_no_dir


# pathlib, shutil and Orbax (through etils.epath) all rename through these two.
os.rename, os.replace = refusing(os.rename), refusing(os.replace)
sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
