"""Files and folders put in place whole: written under a temporary name beside the target, then renamed over it, so
a reader (or a run resumed after kill -9) never sees half of one. Imports only the standard library."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path`; on any failure the temporary
    file goes and `path` is left as it was."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """`text` as the whole of `path`, on disk (fsync) before the rename: a crash leaves the old file or the new."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


def replace_dir(new: Path, out_dir: Path) -> None:
    """Rename `new` to `out_dir`. An old `out_dir` is renamed aside first and deleted after: deleting it in
    place could be cut short, leaving a half-deleted folder under the name readers look for."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old."))
        os.replace(out_dir, old / out_dir.name)
    os.replace(new, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
