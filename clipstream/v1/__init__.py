"""Generated gRPC stubs of protos/clipstream/v1/*.proto (`make stubs`; not committed)."""
