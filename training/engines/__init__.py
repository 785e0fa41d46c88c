"""Engines: the model + optimizer + schedule behind one interface (base.py), one module per engine
(replicas.py: plain torch, one process or replicas; fsdp.py: FSDP2; deepspeed.py: ZeRO), factory.py to pick
one from the config, and what the torch engines share: gradient sync (grad_allreduce.py) and the
low-precision weight cache with fp32 weight gradients (weight_cache.py)."""
