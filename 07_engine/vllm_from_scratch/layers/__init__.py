"""The building blocks of a decoder-only transformer, tensor-parallel aware: every layer takes
``tp_rank``, ``tp_size`` and ``tp_group`` explicitly, so one process can build and check any rank."""
