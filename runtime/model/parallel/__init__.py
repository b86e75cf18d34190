"""Tensor parallelism (issue 27): the process group and its counted collectives (group.py), each rank's slices of
the checkpoint (shard.py), the modules where the ranks' partial results meet (layers.py), and a rank's model and KV
pool (load.py). The rank processes and the step relay are runtime/serve/worker_rank.py."""
