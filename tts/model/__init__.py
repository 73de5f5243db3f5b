"""What the weights compute: the dual-AR transformer, its layers and config, the paged KV cache,
sampling and the Triton kernels. Knows no engine, text, files or threads."""
