"""Unlinks a sender's shared-memory files once the sender is gone, however it went.

Run by the sender as ``python -I -S _reaper.py`` in its own session. It reads one path per
line on stdin until an empty line (the sender closed cleanly) or end of file, which comes when
the sender dies (even by SIGKILL), then unlinks every path it was given. The empty line lets it
end even while a process the sender forked still holds the pipe. It imports nothing from wsync
or torch.
"""

import os
import sys


def main() -> None:
    paths = set()
    for line in sys.stdin.buffer:
        path = line.rstrip(b"\n")
        if not path:
            break
        if path.startswith(b"/dev/shm/wsync-") and b"/" not in path[len(b"/dev/shm/"):]:
            paths.add(path)
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    main()
