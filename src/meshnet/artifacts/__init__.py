"""Model artifacts: locating GGUF files, and (artifacts issue) manifests, shards and distribution."""
