"""wsync-files: a wsync transport that exchanges weights through files in a shared directory."""

from __future__ import annotations

__version__ = "0.1.0"

from .transport import FilesTransport

__all__ = ["__version__", "FilesTransport"]
