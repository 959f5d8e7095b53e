"""KV cache tiers below the pool: a bounded host tier (int8-compressed on the CPU, pinned host
memory on CUDA) and a disk tier that outlives the process. See docs/kv_tiers.md."""
