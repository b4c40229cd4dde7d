"""KV tiers below the device pool: host memory, then files on disk (`EngineConfig.kv_offload`)."""
