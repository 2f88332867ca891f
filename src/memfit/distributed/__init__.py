"""Many processes: data parallelism and ZeRO sharding on torch.distributed.

One module per parallel technique, each a frozen config plus an ``apply``; communication is
torch.distributed's (DDP, ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``), processes are
started by its elastic launcher. memfit chooses, configures, accounts and predicts.
"""
