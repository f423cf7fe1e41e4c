"""The building blocks of a decoder-only transformer, tensor-parallel aware.

Every layer takes ``tp_rank`` and ``tp_size`` explicitly (and an optional ``tp_group``, a
``torch.distributed`` process group): nothing reads a hidden global, so a single-process test can
build rank 1 of 2 and check its shard.
"""
