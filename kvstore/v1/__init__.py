"""Generated gRPC stubs for kvstore.v1 (rebuild with scripts/gen_proto.py; do not edit)."""
