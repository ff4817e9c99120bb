"""clipstream.training: what makes a model version. Task data, continual methods, the per-worker DeepSpeed
loop, the task job (prepare → fit → evaluate → register) and retrieval evaluation. Stands on the ground
floor (settings, registry, model bundle) and never imports clipstream.services."""
