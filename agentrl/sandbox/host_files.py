"""Reading a sandbox's file from the host without its processes' help, safe against what they left there."""

from __future__ import annotations

import os
import stat

from agentrl.sandbox.base import SpecialFileError


def read_regular_file(root: str, parts: list[str], *, max_bytes: int, path: str) -> bytes:
    """The regular file ``root/parts...``, opened one component at a time relative to the last without
    following links (a link there may point anywhere on the host), without blocking on a FIFO, and
    read only when it is at most ``max_bytes``. ``path`` names the file in errors.

    FileNotFoundError when it is missing (or ``root`` is), IsADirectoryError, SpecialFileError for a link,
    FIFO, socket or device, ValueError when too large."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for i, name in enumerate(parts):
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                raise FileNotFoundError(f"{path} does not exist in the sandbox") from None
            except OSError as exc:  # ELOOP: a link; ENXIO: a socket
                raise SpecialFileError(f"{path} is a link, FIFO or socket, not a regular file") from exc
            os.close(fd)
            fd = nxt
            mode = os.fstat(fd).st_mode
            if i < len(parts) - 1 and not stat.S_ISDIR(mode):
                raise FileNotFoundError(f"{path} does not exist in the sandbox")
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{path} is a directory")
        if not stat.S_ISREG(mode):
            raise SpecialFileError(f"{path} is a link, FIFO or socket, not a regular file")
        if os.fstat(fd).st_size > max_bytes:
            raise ValueError(f"{path} is larger than {max_bytes} bytes")
        os.set_blocking(fd, True)
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"{path} is larger than {max_bytes} bytes")
        return data
    finally:
        os.close(fd)
