"""Tensor parallelism: one model split across several processes (GPUs, or CPU ranks with
gloo), each running its shard of every layer. ranks.py places the processes (torch-free:
the API process starts them), group.py is their communication, followers.py keeps ranks
1.. stepping with rank 0, which schedules."""
