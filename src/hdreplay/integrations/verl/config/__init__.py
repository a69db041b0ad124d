"""Hydra config of the verl recipe (``hdr_trainer.yaml``), shipped as package data."""
