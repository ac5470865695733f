"""A sharded worker group: N processes on one node (one a GPU) serving one base model split
with tensor parallelism (model/tensor_parallel.py) as one worker. `launcher` starts and watches
the ranks; rank 0 runs the ordinary worker runtime with a `leader` engine that broadcasts each
call over the `channel`; the other ranks `follow` it. See docs/architecture.md."""
