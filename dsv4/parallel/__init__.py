"""Several processes, one model (docs/architecture.md, "Parallelism"): process groups and
collectives (`comm.py`), the tensor-parallel sharding transform (`tensor_parallel.py`), expert
parallelism under TP and under data-parallel attention (`expert_parallel.py`)."""
