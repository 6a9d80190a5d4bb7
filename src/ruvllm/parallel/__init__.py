"""Tensor parallelism (docs/scaling.md): one process per rank, each holding a slice of every layer.

layout.py     which heads, MLP columns and vocabulary rows a rank holds; what a model must satisfy
support.py    the engine settings and weight forms tensor parallelism runs, refused by name otherwise
sharding.py   a rank's slice of each Hugging Face-named tensor
group.py      the ranks' process groups (torch.distributed: gloo, NCCL) and the collectives used
layers.py     row-parallel linears, the vocabulary-parallel embedding, the sharded Llama model
step_inputs.py  rank 0's commands to the other ranks (a step's inputs, logits rows, KV pool size)
shard.py      one rank's model and runner, built the same way on every rank
ranks.py      rank 0's side: starting the other ranks' processes, joining them, stopping them
rank_process.py  the other ranks' main: join, load, then follow rank 0's commands
"""
