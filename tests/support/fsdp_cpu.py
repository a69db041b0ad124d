"""FSDP2 on a CPU-only machine: the one substitute the tests and benchmarks/trl_memory.py make.

accelerate 1.15 selects FSDP only on an accelerator device: on CPU its state reports ``MULTI_CPU`` and the plugin
the Trainer passes is dropped silently (``AcceleratorState.__init__``, device branch).  :func:`engage_fsdp_on_cpu`
lets the Trainer build its Accelerator as usual, then sets the state's distributed type and ``fsdp_plugin`` to what
accelerate sets on a GPU.  Everything after that is accelerate's and torch's own: ``prepare`` shards the model with
``fully_shard`` (gloo), the optimizer, ``no_sync``, gradient clipping and the sharded checkpoints.
"""

from __future__ import annotations


def engage_fsdp_on_cpu() -> None:
    """From now on, every Trainer's Accelerator in this process runs FSDP with the Trainer's plugin."""
    import transformers.trainer as hf_trainer
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    real = hf_trainer.Accelerator

    def accelerator(**kw):
        acc = real(**kw)
        assert acc.state.distributed_type == DistributedType.MULTI_CPU  # 1.15: the plugin was dropped
        # (every AcceleratorState() call re-reads the type from PartialState's shared state: set it there too)
        PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = kw["fsdp_plugin"]
        return acc

    hf_trainer.Accelerator = accelerator
