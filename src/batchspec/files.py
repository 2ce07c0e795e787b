"""Files written whole or not at all (reports, baselines, outputs): a reader never sees half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path, write) -> Path:
    """Write the text file ``path`` whole or not at all: ``write(f)`` fills a new file in the same folder, which is
    flushed to disk and then renamed over ``path`` (keeping an existing file's permissions). A reader never sees a
    half-written file, and when writing fails (a full disk, a lost mount) the new file is removed and the previous
    one at ``path`` stays as it was; the error is one line (a ValueError: exit status 2) saying so."""
    path = Path(path)
    real = Path(os.path.realpath(path))  # through a symlink to its file, which is replaced; the link stays
    tmp = real.with_name(f".{real.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if real.exists():
            os.chmod(tmp, real.stat().st_mode & 0o7777)
        os.replace(tmp, real)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError):
            kept = "the previous file is unchanged" if real.exists() else "nothing was written"
            raise ValueError(f"could not write {path}: {e.strerror or e}; {kept}") from None
        raise
    return path
