"""Crash-safe checkpoint directories: the manifest swap, one writer at a time (the lock), atomic small files, the
streamed tensor file format.  Open ``files.py`` first (``dirlock.py`` for the writer lock)."""
