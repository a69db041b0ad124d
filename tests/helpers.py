"""Test helpers: the model-free policy and group generator live in the package (hdreplay.synthetic)."""

from hdreplay.synthetic import TablePolicy, make_group  # noqa: F401
