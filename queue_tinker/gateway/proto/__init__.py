"""Protobuf messages of the public tinker SDK wire format (generated module + .proto)."""
