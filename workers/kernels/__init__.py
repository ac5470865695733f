"""Kernels the training pass and the sampler share: grouped (segment) matmuls for many LoRA
adapters in one pass, written in Triton where torch has no kernel of its own."""
