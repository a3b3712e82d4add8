"""How each stage runs, for one request or a batch: the AR runner (KV slots, graphs, compile), token2wav (flow +
HiFT, offline and streaming), the hop schedule, and the StageBackends (engines, CUDA graphs, compiled functions)
handed explicitly to whoever runs a stage. `pipeline.py` is the eager single-request reference path."""
