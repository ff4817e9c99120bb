"""Reproducible benchmarks, each a script under `benchmarks/` that writes its table (and plot) to
`benchmarks/results/`, run as `clipstream bench NAME [OPTIONS]` or `python benchmarks/MODULE.py`.
Every figure is measured side by side against its baseline in the same run."""

# `clipstream bench NAME` -> the module that runs it (imported only when asked: they pull in Ray, DeepSpeed...)
BENCHMARKS = {
    "all": "suite",  # every cost benchmark below in one run (--quick: small sizes), with the summary of targets
    "methods": "continual_methods",  # every continual method on one stream: AA, forgetting, BWT, step cost
    "languages": "languages",
    "world": "world",  # version 0 of the emoji world pretrained here, on each stream's first task, against its floors  # CLL-CLIP and TEIR on a language stream against fine-tuned token embeddings
    "index-policy": "index_policy",  # no-reindex vs reindex through the vector index
    "method-step": "method_step",  # each method's training step against finetune's, same batches
    "train-throughput": "train_throughput",  # the task job against a plain PyTorch open_clip loop
    "grpc-encode": "grpc_encode",  # gRPC encoding through Ray Serve against the in-process model
    "search": "search",  # vector search and the Search RPC at 10k-1M vectors against exact numpy search
    "indexing": "indexing",  # clipstream index against an in-process encode loop; reindex/append against index size
    "reliability": "reliability",  # serving under load and faults; every fault and bad input with its outcome
    "stream-growth": "stream_growth",  # wall, step, memory and evaluation time per task as the stream grows
    "first-run": "first_run",  # `clipstream demo` as a new user sees it: time, lines printed, processes left
    "data-check": "data_check",  # a task's images checked and hashed before a job, against a plain loop
    "cli-startup": "cli_startup",  # `clipstream --help`, `--version`, a command's --help: seconds to answer
    "gpu": "gpu",  # bf16 DeepSpeed training throughput, MFU and encoder images/s on a GPU (skipped without one)
}
