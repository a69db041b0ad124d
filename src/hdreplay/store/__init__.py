"""The group and its storage: a group's immutable record, its ingest from trainer rows, padding, images, and the FIFO
buffer of ragged blocks with its checkpoint schema.  Open ``buffer.py`` first (``record.py`` for what a group holds)."""
