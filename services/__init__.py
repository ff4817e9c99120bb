"""clipstream.services: what serves a model version. The Ray Serve gRPC application (Encoder ingress,
Search, Admin) and the Python client. Stands on the ground floor (settings, registry, vector index, model
bundle, stubs) and never imports clipstream.training."""
